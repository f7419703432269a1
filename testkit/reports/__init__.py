"""How each bench shows its numbers: the markdown of a scenario (tables of min / median / max over
paired rounds), one module per bench/ script, called with the results the script measured."""
