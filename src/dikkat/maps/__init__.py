"""Attention maps of real models: run a model on one input under :func:`dikkat.capture` and
keep what its layers, heads and query rows looked at as :class:`~dikkat.viz.maps.AttentionMaps`
(docs/show.md); attention rollout; and the check of whether the attention explains the output.

    tm = dikkat.maps.text_model(dikkat.pretrained.minilm())
    maps = dikkat.maps.text_maps(tm, "The animal didn't cross the street because it was too tired.")
"""

from dikkat.maps.collect import collect, find_token, layer_family, token_labels
from dikkat.maps.faithfulness import Faithfulness, rank, spearman, text_faithfulness
from dikkat.maps.hf import hf_model
from dikkat.maps.image import image_faithfulness, vit_maps
from dikkat.maps.rollout import rollout, rollout_maps
from dikkat.maps.text import TextModel, encode_text, text_maps, text_model
from dikkat.maps.translation import (
    Translation,
    translate,
    translation_faithfulness,
    translation_maps,
)

__all__ = [
    "Faithfulness",
    "TextModel",
    "Translation",
    "collect",
    "encode_text",
    "find_token",
    "hf_model",
    "image_faithfulness",
    "layer_family",
    "rank",
    "rollout",
    "rollout_maps",
    "spearman",
    "text_faithfulness",
    "text_maps",
    "text_model",
    "token_labels",
    "translate",
    "translation_faithfulness",
    "translation_maps",
    "vit_maps",
]
