"""Diffusion transformers: a small class-conditional DiT trained here, quantized to compressed-tensors,
run in a diffusers pipeline, and judged by an image structure gate.

    data.py      the training set: scikit-learn's bundled 8x8 digits as RGBA images (procedural colour,
                 alpha = the digit's ink)
    pipeline.py  DigitsDiTPipeline (a diffusers DiffusionPipeline: DiTTransformer2DModel + DDIM, pixel
                 space, classifier-free guidance, one noise generator per seed)
    train.py     deterministic training -> a diffusers directory artifact (manifest: sha256, commit, steps, seed)
    quantize.py  `lowbit quantize --component transformer`: RTN / GPTQ of the DiT's linears -> a diffusers
                 directory whose transformer/ is a compressed-tensors checkpoint
    load.py      lowbit's loader for such directories (QuantLinear modules; manifest verified)
    gate.py      per-image structure metrics and the gate (thresholds, calibration from the seed spread)
    evaluate.py  `lowbit eval images`; bench.py: `lowbit bench images` (capacity matrix)

diffusers is the `diffusion` extra: `pip install -c constraints-cpu.txt -e '.[diffusion]'`.
"""
