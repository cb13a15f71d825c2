"""Loading models: the bundled GGUF files, Hugging Face folders, precision modes."""
