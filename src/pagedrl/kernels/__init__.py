"""What the CPU can run, asked once and below every layer that runs kernels on it."""
