"""A small GPT-style byte-level language model, the main job's LightningModule.

Blocks are named ``blocks.<i>`` so fragment layouts can stride over layers (FSDP keeps names)."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torchmetrics.text import Perplexity

from lightning_swarm.errors import SwarmConfigError
from lightning_swarm.pipeline.stages import keep_stage

# The demo's default sizes, quoted by the error a non-positive size raises.
DEFAULT_SIZES = {"block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128}


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int
    ) -> None:
        super().__init__()
        sizes = {"block_size": block_size, "n_layer": n_layer, "n_head": n_head, "n_embd": n_embd}
        for name, value in sizes.items():
            # A GPT of no blocks (n_layer=0) would train its embeddings alone and exit 0.
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SwarmConfigError(
                    f"model.{name}={value!r} must be a positive integer; e.g. model.{name}="
                    f"{DEFAULT_SIZES[name]} (the default)."
                )
        if n_embd % n_head != 0:
            raise SwarmConfigError(
                f"model.n_embd={n_embd} must be divisible by model.n_head={n_head}"
            )
        self.block_size = block_size
        # Under pipeline stages (keep_stage) the first stage alone keeps the embeddings and the
        # last the final norm and head; the others hold None there, which forward skips.
        self.tok_emb: nn.Embedding | None = nn.Embedding(vocab_size, n_embd)
        self.pos_emb: nn.Embedding | None = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(n_embd)
        self.head: nn.Linear | None = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        """Byte ids to logits; on a pipeline stage, from its input (ids on the first stage,
        hidden states after) to its output (logits on the last stage, hidden states before)."""
        if self.tok_emb is not None and self.pos_emb is not None:
            t = x.shape[1]
            if t > self.block_size:
                raise ValueError(f"sequence of {t} exceeds block_size {self.block_size}")
            pos = torch.arange(t, device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        if self.ln_f is not None and self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def next_byte_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of the next byte (also each pipeline micro-batch's loss)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class GPTLightningModule(pl.LightningModule):
    """Byte-level GPT trained with AdamW (the inner optimizer), linear warm-up then constant.

    ``val_across_islands`` reduces validation metrics over every rank (a world collective);
    ``False`` keeps each rank's own, as rounds on a time budget need (docs/speeds.md).
    """

    def __init__(
        self,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 50,
        val_across_islands: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.weight_decay, self.betas = lr, weight_decay, (betas[0], betas[1])
        self.warmup_steps = warmup_steps
        self.model = GPT(256, block_size, n_layer, n_head, n_embd)
        self.val_across_islands = val_across_islands
        # torchmetrics types its keywords as dicts; the option is a bool.
        options: dict[str, Any] = {"sync_on_compute": val_across_islands}
        self.val_perplexity = Perplexity(**options)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def configure_model(self) -> None:
        """With an island mesh: keep this rank's pipeline stage (when the mesh has a
        ``pipeline_parallel`` dimension), then FSDP2 over ``data_parallel`` when it has more
        than one rank (or no stages: the FSDP islands of docs/fsdp.md)."""
        mesh = self.device_mesh
        if mesh is None:
            return
        staged = "pipeline_parallel" in (mesh.mesh_dim_names or ())
        if staged:
            keep_stage(
                self.model,
                mesh,
                blocks="blocks",
                first=["tok_emb", "pos_emb"],
                last=["ln_f", "head"],
            )
            if mesh["data_parallel"].size() == 1:
                return  # plain stages (DDP inside a stage averages their gradients)
        data_parallel = mesh["data_parallel"]
        for block in self.model.blocks:
            if isinstance(block, Block):  # not another stage's placeholder
                fully_shard(block, mesh=data_parallel)
        fully_shard(self.model, mesh=data_parallel)  # the embeddings, final norm and head

    def _staged(self) -> Any:
        """The strategy's ``pipeline_step`` when its islands have pipeline stages, else None."""
        strategy = self.trainer.strategy
        stages = getattr(getattr(strategy, "config", None), "pipeline_parallel_size", 1)
        return strategy.pipeline_step if stages > 1 else None  # type: ignore[attr-defined]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        pipeline_step = self._staged()
        if pipeline_step is not None:
            loss = pipeline_step(x, y, next_byte_loss)
        else:
            loss = next_byte_loss(self.model(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        pipeline_step = self._staged()
        if pipeline_step is not None:
            # Logits exist on the last stage only: the loss (on every rank) is what is logged.
            loss = pipeline_step(x, y, next_byte_loss)
        else:
            logits = self.model(x)
            loss = next_byte_loss(logits, y)
            self.val_perplexity.update(logits, y)
            self.log("val_ppl", self.val_perplexity, prog_bar=True)
        self.log("val_loss", loss, prog_bar=True, sync_dist=self.val_across_islands)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        params = list(self.parameters())
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)
        warmup = max(1, self.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
