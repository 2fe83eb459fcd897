"""The msds transformer (architecture), its parameter-role table and Hugging Face interop."""
