"""Multi-LoRA serving: PEFT adapters applied beside the base products, several adapters in one step."""
