"""LoRA adapters: --lora-modules values, the runtime load/unload routes, --lora-modules-file sync."""
