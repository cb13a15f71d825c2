"""The engine core: the step loop, its scheduler, input and output processing, weights and memory lifecycle."""
