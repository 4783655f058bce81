"""Text conditioning: captions' embeddings as the network sees them (condition.py), the text encoders that make
them (encoders.py), what their tokenizers make of a run's own text (tokens.py, before any job), prepare's cache
of them (cache.py) and where a run takes them from (source.py).

Imports the base modules and runtime only: data, nets, objectives, training and sampling import it."""
