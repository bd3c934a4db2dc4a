"""Tiny random DiT pipelines for the diffusion tests (no training, no scikit-learn)."""

import pytest
import torch

pytest.importorskip("diffusers")


def tiny_pipeline(seed: int = 0, hidden: int = 64, heads: int = 2, layers: int = 2, size: int = 16, patch: int = 4):
    from diffusers import DiTTransformer2DModel

    from lowbit.diffusion.pipeline import DigitsDiTPipeline
    from lowbit.diffusion.train import TrainConfig, make_schedulers

    torch.manual_seed(seed)
    tr = DiTTransformer2DModel(num_attention_heads=heads, attention_head_dim=hidden // heads, in_channels=4,
                               out_channels=4, num_layers=layers, sample_size=size, patch_size=patch,
                               num_embeds_ada_norm=10).eval()
    _, sched = make_schedulers(TrainConfig())
    return DigitsDiTPipeline(transformer=tr, scheduler=sched)


def write_tiny(path, **kw):
    from lowbit.diffusion.train import save_pipeline_artifact

    save_pipeline_artifact(tiny_pipeline(**kw), path, inputs={"test": "tiny random DiT"}, recipe={}, counts={})
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("dit") / "tiny")
