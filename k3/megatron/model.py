"""The K3 model provider: megatron's ``GPTModel`` with the K3 block spec.

``GPTModel`` gives the vocab-parallel embedding and LM head, the pipeline-stage plumbing and the loss
(vocab-parallel cross entropy when ``labels`` are passed); the decoder is ``get_k3_spec``'s. No position
embedding (K3 has none), untied head. Packed sequences pass through as megatron's ``packed_seq_params``
(``k3.megatron.packed``); activation recompute is megatron's (``k3.megatron.recompute``).
"""

from __future__ import annotations

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from k3.megatron.config import K3TransformerConfig
from k3.megatron.recompute import require_decoder_input_grad
from k3.megatron.sequence_major import canonical_head_grad
from k3.megatron.spec import get_k3_spec

__all__ = ["k3_model_provider"]


def k3_model_provider(config: K3TransformerConfig, pre_process: bool | None = None,
                      post_process: bool | None = None, vp_stage: int | None = None) -> GPTModel:
    """This rank's pipeline stage of K3 (the whole model at PP = 1), on the config's dtype.

    ``pre_process``/``post_process`` (embedding / final norm and head) default to whether this rank is the
    first / last pipeline stage. Build it after ``initialize_model_parallel`` (see ``k3.megatron.parallel``).
    """
    if vp_stage is not None:
        raise ValueError("K3 does not support virtual pipeline parallelism (vp_stage must be None)")
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    cfg = config.k3
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_k3_spec(config),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="none",
    )
    if pre_process and config.recompute_granularity is not None:
        require_decoder_input_grad(model)  # megatron's checkpoints are reentrant (k3.megatron.recompute)
    if post_process:
        canonical_head_grad(model)  # the head's input gradient as one GEMM, not one per token
    return model
