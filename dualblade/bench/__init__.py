"""The paper's experiments as a tool: policies, memory-limit sweeps, metrics and plots."""
