"""What training runs forward: the trainable drafter with the target's frozen embedding and LM head, from target
features and blocks to the blocks' logits (and, for a DFlash2 drafter, its selector's candidate scores)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash.model.dflash2 import walk_on_device
from dflash.model.drafter import DFlashDraftModel
from dflash.model.target import TargetModel


@dataclass
class DraftOutput:
    logits: torch.Tensor  # (b, n*B, vocab)
    hidden: torch.Tensor  # (b, n*B, h): the drafter's final normed hidden states
    candidates: torch.Tensor | None = None  # DFlash2 (b, n*B, K): each position's top candidates
    selector_scores: torch.Tensor | None = None  # DFlash2 (b, n*B, K): their scores after the true previous token


class DraftingHead(nn.Module):
    """The trainable drafter plus the target's frozen embedding and LM head: features + blocks -> DraftOutput.

    The frozen pieces are held outside the module tree so DDP neither syncs nor saves them; everything that
    trains (a DFlash2 selector too) runs inside `forward`, so DDP sees its gradients.
    """

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel):
        super().__init__()
        self.drafter = drafter
        self._target = [target]

    def forward(self, features, block_tokens, block_positions, context_valid, attn_mask,
                previous: torch.Tensor | None = None) -> DraftOutput:
        """previous (b, n*B): the true token before each position, for a DFlash2 selector's scores."""
        context = self.drafter.project_context(features)  # (b, T, h)
        return self.draft(context, block_tokens, block_positions, context_valid, attn_mask, previous)

    def draft(self, context, block_tokens, block_positions, context_valid, attn_mask,
              previous: torch.Tensor | None = None) -> DraftOutput:
        """The blocks' outputs from an already projected context (b, T, h)."""
        target = self._target[0]
        b, T = context.shape[:2]
        context_positions = torch.arange(T, device=context.device)[None].expand(b, T)
        embeds = target.embed(block_tokens).to(context.dtype)
        hidden = self.drafter(embeds, block_positions, context, context_positions, context_valid=context_valid,
                              attn_mask=attn_mask, block_width=self.drafter.config.block_size)
        out = DraftOutput(target.lm_head(hidden.to(target.dtype)), hidden)
        selector = self.drafter.selector
        if selector is not None and previous is not None:  # a head on the drafter: its loss trains the selector only
            unary, out.candidates = out.logits.detach().topk(selector.top_k, dim=-1)  # (b, n*B, K)
            out.selector_scores = selector.pair_scores(unary, out.candidates, previous[..., None],
                                                       hidden.detach())[..., 0, :]
        return out

    @torch.no_grad()
    def drafted_tokens(self, out: DraftOutput, block_tokens: torch.Tensor) -> torch.Tensor | None:
        """(b, n*B) the draft tokens decoding would propose in each block (its anchor kept at position 0): the
        selector's path for a DFlash2 drafter; None for DFlash, whose draft is each position's argmax."""
        selector = self.drafter.selector
        if selector is None:
            return None
        B = self.drafter.config.block_size
        b = block_tokens.shape[0]
        blocks = block_tokens.reshape(-1, B)  # (b*n, B)
        lattice = selector.lattice(out.logits.reshape(blocks.shape[0], B, -1)[:, 1:].float(),
                                   out.hidden.reshape(blocks.shape[0], B, -1)[:, 1:], blocks[:, 0])
        tokens, _ = walk_on_device(lattice)  # (b*n, B-1): decoding's path (`walk`), without a host round trip
        return torch.cat([blocks[:, :1], tokens], dim=1).view(b, -1)
