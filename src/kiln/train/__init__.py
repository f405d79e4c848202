"""Training: the generic loop (``Trainer``) and its components, optimizer and schedules, precision,
and the built-in language-model job (``lm``)."""
