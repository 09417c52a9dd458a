"""The pieces of `tools/make_random_model.py`: presets, weights, the recipe, the tokenizer, ONNX stand-ins."""
