"""The main job's demo: a small GPT, its corpus and its loss plot (Lightning glue)."""
