"""Prompts with images: the images read from what a caller sent (images.py), the model's HF processor turning a
rendered prompt and its images into token ids and the vision encoder's inputs (processor.py), and those inputs as
the step message carries them to the runner (inputs.py)."""
