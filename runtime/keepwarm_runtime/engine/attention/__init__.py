"""keepwarm attention: discovered in transformers modules, attached as child layers, paged KV backends."""
