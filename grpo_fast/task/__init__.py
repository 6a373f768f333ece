"""The task: data files, prompt templates, reward functions, the built-in tiny task, and ``load_task``."""
