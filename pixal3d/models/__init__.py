"""The networks of the cascade, registered under the class names their checkpoint json files use."""
from .loading import (MODEL_CLASSES, CheckpointError, build_model, load_model, load_state_into, read_spec,
                      register_model, save_model)

__all__ = ["MODEL_CLASSES", "CheckpointError", "build_model", "load_model", "load_state_into", "read_spec",
           "register_model", "save_model"]
from .slat_flow import SLatFlowModel
from .sparse_structure_flow import SparseStructureFlowModel
from .sparse_structure_decoder import SparseStructureDecoder
from .sparse_unet_vae import FlexiDualGridVaeDecoder, SparseUnetVaeDecoder
from .naf import NAF
from .shape_encoder import FlexiDualGridVaeEncoder
