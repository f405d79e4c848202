"""The training loop (generic ``Trainer``), optimizer and schedules, precision, and the GPT job."""
