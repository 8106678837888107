"""The `yb` tool: the CLI, the local launcher and its nats-server, the load generator,
the simulator, profiling and plots. It sits on top and may use every other package."""
