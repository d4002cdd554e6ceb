"""
A GPT-2 language model with four residual modes, in one file:

  baseline     x_k = x_{k-1} + f_k(LN(x_{k-1}))                    the standard pre-norm residual
  attnres      u_k = read(sources)            replacement routing  Kimi's (Block) Attention Residuals
  delta        u_k = x_{k-1} + read(sources)  additive, per layer  Delta Attention Residuals
  delta_block  u_k = x_{k-1} + read(blocks)   additive, per block  Delta Block

Every attention and every MLP is a sublayer f_k (k = 1..S, S = 2*n_layer), v_k = f_k(LN_k(u_k)). A
sublayer's router holds a zero-initialised pseudo-query w and an RMSNorm gain g and reads its
sources s_i:

    alpha_i = softmax_i(w . RMSNorm_g(s_i))        read = sum_i alpha_i * s_i

The sources are the pieces of the residual stream: the embedding e and the sublayer outputs
v_1..v_{k-1}, or their sums over blocks of sublayers. They telescope (sum to x_{k-1}) in attnres,
delta and delta_block with route_partial, so with all queries at zero those compute the baseline's
function (LayerNorm is scale invariant); plain delta_block and route_sources="cumulative" do not.
docs/method.md states the method in full. The code follows nanoGPT's model.py, names included.

Read top-down: LayerNorm, attention, MLP, the Router, the Stream (where the four modes differ),
Block, GPTConfig, GPT. The file's last section is a fast path for routing (the same numbers to float
rounding, activation memory linear in depth, fewer passes); a first reading can skip it. Which path
runs is GPTConfig.fast_routing: the cpu preset, where a class trains, runs Router and Stream as
written, so an edit of them shows; every other preset and the study files take the fast path. Tests
hold the two paths equal.

References:
1) nanoGPT: https://github.com/karpathy/nanoGPT/blob/master/model.py
2) Attention Residuals (Kimi): arXiv 2603.15031
3) Delta Attention Residuals: arXiv 2605.18855
"""

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

RESIDUALS = ("baseline", "attnres", "delta", "delta_block")
ROUTE_SOURCES = ("delta", "cumulative")
# per-token weights from the sources, or one learned weight per source
ROUTE_WEIGHTS = ("dynamic", "static")
ROUTE_EPS = 1e-6  # RMSNorm eps of the router keys
ROUTING_FIELDS = ("n_route_blocks", "route_partial", "route_sources",  # GPTConfig's routing options
                  "route_weights", "route_heads")
GPT2_MODELS = {  # the Hugging Face GPT-2 weights from_pretrained loads, with their shapes
    'gpt2':         dict(n_layer=12, n_head=12, n_embd=768),  # 124M params
    'gpt2-medium':  dict(n_layer=24, n_head=16, n_embd=1024), # 350M params
    'gpt2-large':   dict(n_layer=36, n_head=20, n_embd=1280), # 774M params
    'gpt2-xl':      dict(n_layer=48, n_head=25, n_embd=1600), # 1558M params
}


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False"""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None
        self.eps = 1e-5

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, self.eps)


class CausalSelfAttention(nn.Module):
    # SDPA (flash attention) is the fast path; False runs the readable manual path below
    flash = True

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x, cache=None):
        B, T, C = x.size() # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v  = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        P = 0 # positions before these T
        if cache is not None:  # generation: the P cached keys and values come first (KVCache)
            P = len(cache)
            k, v = cache.extend(k, v) # (B, nh, P+T, hs)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, P+T) -> (B, nh, T, P+T)
        if self.flash:
            # nanoGPT's causal square when nothing is cached; one new query sees every key
            mask = None if P == 0 or T == 1 else causal_mask(T, P, x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=P == 0,
                                               dropout_p=self.dropout if self.training else 0)
        else:
            # manual implementation of attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~causal_mask(T, P, x.device), float('-inf'))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v # (B, nh, T, P+T) x (B, nh, P+T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C) # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


def causal_mask(T, P, device):
    """(T, P+T) bool: query t, at position P+t, sees keys 0..P+t."""
    return torch.ones(T, P + T, dtype=torch.bool, device=device).tril(P)


class KVCache:
    """One layer's keys and values of the positions generation has already run, (B, nh, P, hs), so
    that each step runs only the new tokens (routing is per token: nothing else needs caching)."""

    def __init__(self):
        self.k = self.v = None

    def __len__(self):  # P; an empty cache is falsy, so test `cache is not None`, not `if cache`
        return 0 if self.k is None else self.k.size(2)

    def extend(self, k, v):
        """The cached keys and values with the new ones after them, (B, nh, P+T, hs), kept for
        the next step."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc    = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu    = nn.GELU()
        self.c_proj  = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Router(nn.Module):
    """Attention over depth: a sublayer's per-token weighted read of its sources s_1..s_n (B, T, D),
        alpha_i = softmax_i(w . RMSNorm_g(s_i))        read = sum_i alpha_i * s_i
    with no 1/sqrt(D) and no temperature; w starts at zero (uniform weights), g at one. With H heads
    the D channels are cut into H contiguous groups [h], each routed with its own weights:
        alpha_i^h = softmax_i(w_h . RMSNorm_g(s_i)[h])     read[h] = sum_i alpha_i^h * s_i[h]
    The keys are normed over the full width, then cut, so a source's H head scores sum to its
    one-head score; no parameter is added. Static routing (the control):
    alpha_i^h = softmax_i(b_i^h), one learned logit per source and head, zero-init, the same for
    every token. Logits and softmax run in float32 (float64 in a float64 model), also under
    autocast."""

    def __init__(self, n_embd, heads=1, static_sources=None):
        super().__init__()
        self.heads, self.static = heads, static_sources is not None
        if self.static:  # b: one logit per head and source; no query, no keys
            self.logits = nn.Parameter(torch.zeros(heads, static_sources))
        else:
            self.query = nn.Parameter(torch.zeros(n_embd))  # w
            self.norm = nn.RMSNorm(n_embd, eps=ROUTE_EPS)  # RMSNorm_g: its weight is the key gain g

    def forward(self, sources):
        """sources: n tensors (B, T, D) -> read (B, T, D), alpha (B, T, H, n) (H = 1: one head)."""
        H = self.heads
        with torch.autocast(sources[0].device.type, enabled=False):
            s = [upcast(s_i).unflatten(-1, (H, -1)) for s_i in sources]  # s_i[h], (B, T, H, D/H)
            if self.static:
                # b_i^h, (B, T, H, n)
                logits = upcast(self.logits).expand(*s[0].shape[:2], H, -1)
            else:
                w = upcast(self.query).view(H, -1)  # w_h, (H, D/H)
                # RMSNorm_g(s_i)[h]
                keys = [self.norm(upcast(s_i)).unflatten(-1, (H, -1)) for s_i in sources]
                # w_h . RMSNorm_g(s_i)[h]
                logits = torch.stack([(k * w).sum(-1) for k in keys], dim=-1)
            alpha = logits.softmax(dim=-1)  # over the sources, per head
            # read[h] = sum_i alpha_i^h s_i[h]
            read = sum(alpha[..., i, None] * s_i for i, s_i in enumerate(s))
        return read.flatten(-2).to(sources[0].dtype), alpha


def upcast(t):
    """t in float32 (or float64 if it is): routing logits and softmax never run in bf16/fp16."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


class Stream:
    """The residual stream of one forward pass: what sublayer k reads (u_k) and where its output
    v_k goes.

    `read(router)` gives u_k, `write(v)` takes v_k. The four modes differ only here, by two flags:
      baseline            keeps_stream             u_k = x_{k-1}                  (router is None)
      delta, delta_block  keeps_stream and routed  u_k = x_{k-1} + read(sources)  (additive routing)
      attnres             routed                   u_k = read(sources)            (replacement)
    and after the last sublayer attnres's final router reads all sources. The sources are e and the
    completed blocks b_1, b_2, ... (each the sum of its sublayers' v's; per sublayer, N = S, each v
    is a block), plus the current block's partial sum where it is routed and not empty.
    route_sources="cumulative" swaps each source for the stream's value x at that boundary.
    """

    def __init__(self, e, config, record=None):
        # a running stream x: every mode but replacement
        self.keeps_stream = config.residual != "attnres"
        self.routed = config.residual != "baseline"
        self.x = e                  # the running stream x_{k-1} (unused by attnres)
        self.blocks = [e]           # e, then each completed block's source
        self.partial = None         # the current block's sum of v's so far
        self.k = 0                  # sublayers written so far
        self.block_len = config.n_sublayers // (config.n_route_blocks or 1)
        self.route_partial = config.route_partial
        self.cumulative = config.route_sources == "cumulative"
        self.record = record        # a list to collect (sources, alpha) for statistics

    def as_source(self, s):
        """A block's sum of v's as a source: itself, or for cumulative sources the stream at the
        block's end."""
        if self.cumulative:
            return self.blocks[-1] + s
        return s

    def sources(self):
        """What a router reads now: e and the completed blocks, and the partial sum if routed and
        not empty."""
        if self.partial is None or not self.route_partial:
            return list(self.blocks)
        return self.blocks + [self.as_source(self.partial)]

    def read(self, router):
        if router is None:
            return self.x
        sources = self.sources()
        read, alpha = router(sources)
        if self.record is not None:
            self.record.append((sources, alpha))
        if self.keeps_stream:
            return self.x + read
        return read

    def write(self, v):
        self.k += 1
        if self.keeps_stream:
            self.x = self.x + v
        if self.routed:
            self.partial = v if self.partial is None else self.partial + v
            if self.k % self.block_len == 0:  # block complete: its sum becomes a source
                self.blocks.append(self.as_source(self.partial))
                self.partial = None

    def output(self, final_router):
        """x_S where the mode keeps a stream; for replacement routing the final router's read of
        all sources."""
        return self.x if self.keeps_stream else self.read(final_router)


class Block(nn.Module):

    def __init__(self, config, i):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.attn_router = make_router(config, 2 * i)      # None for the baseline
        self.mlp_router = make_router(config, 2 * i + 1)
        # True: activation checkpointing, each f(LN(u)) runs again in backward
        self.recompute = False

    def forward(self, stream, cache=None):
        u = stream.read(self.attn_router)               # u_k: the stream x_{k-1}, a read, or both
        v = self.sublayer(self.attn, self.ln_1, u, cache)  # v_k = f_k(LN_k(u_k))
        stream.write(v)                                 # x_k = x_{k-1} + v_k, and v_k a source
        u = stream.read(self.mlp_router)
        v = self.sublayer(self.mlp, self.ln_2, u)
        stream.write(v)

    def sublayer(self, f, ln, u, *args):
        """v = f(LN(u)). With recompute (and grad enabled) its activations are not kept for backward
        but computed again there; routing and the stream are not recomputed."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(lambda u: f(ln(u), *args), u, use_reentrant=False)
        return f(ln(u), *args)


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304 # GPT-2 vocab_size of 50257, padded up to nearest multiple of 64 for efficiency
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True # True: bias in Linears and LayerNorms, like GPT-2. False: a bit better and faster
    residual: str = "baseline" # baseline | attnres | delta | delta_block
    # routing; None takes the mode's default (routing_defaults below),
    # and stays None for the baseline
    n_route_blocks: Optional[int] = None # N: the 2*n_layer sublayers cut into N blocks of sources
    route_partial: Optional[bool] = None # also route the current block's partial sum
    route_sources: Optional[str] = None # "delta" (block sums) or "cumulative" (stream snapshots)
    # "dynamic" (per token) or "static" (one learned logit per source)
    route_weights: Optional[str] = None
    # H: route H contiguous channel groups apart (multi-head routing)
    route_heads: Optional[int] = None
    # the file's last section; False: Router and Stream as written. Not architecture
    fast_routing: bool = True

    def __post_init__(self):
        unset = {name for name in ROUTING_FIELDS if getattr(self, name) is None}
        check_gpt_config(self)  # one clear ValueError for a bad value (the checks follow GPT)
        if self.residual != "baseline":
            for name in unset:
                setattr(self, name, routing_defaults(self.residual, self.n_layer)[name])
            check_routing(self, unset)

    @property
    def n_sublayers(self):
        return 2 * self.n_layer


def routing_defaults(residual, n_layer):
    """A routed mode's defaults: delta routes per sublayer, attnres and delta_block over 4 blocks;
    attnres reads the current partial block (Kimi's definition), delta_block only completed ones
    (the paper's)."""
    return dict(n_route_blocks=2 * n_layer if residual == "delta" else 4,
                route_partial=residual != "delta_block",
                route_sources="delta", route_weights="dynamic", route_heads=1)


def sources_per_router(cfg):
    """The number of sources each router reads, in order (the final router last): no data needed."""
    if cfg.residual == "baseline":
        return []
    S, L = cfg.n_sublayers, cfg.n_sublayers // cfg.n_route_blocks
    # sublayer k reads e, the (k - 1) // L blocks completed before it, and its own block's partial
    # sum when routed and not empty:
    # with L = 4 sublayer 6 reads e, b1 and b2's partial (v5), 3 sources
    counts = [1 + (k - 1) // L + (cfg.route_partial and (k - 1) % L > 0) for k in range(1, S + 1)]
    if cfg.residual == "attnres":
        counts.append(1 + cfg.n_route_blocks)  # the final router reads e and every block
    return counts


def make_router(config, j):
    """Router j (in the model's order), None for the baseline;
    static routing needs its number of sources."""
    if config.residual == "baseline":
        return None
    if config.route_weights == "static":
        return Router(config.n_embd, config.route_heads,
                      static_sources=sources_per_router(config)[j])
    return Router(config.n_embd, config.route_heads)


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.config = config

        self.transformer = nn.ModuleDict(dict(
            wte = nn.Embedding(config.vocab_size, config.n_embd),
            wpe = nn.Embedding(config.block_size, config.n_embd),
            drop = nn.Dropout(config.dropout),
            h = nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f = LayerNorm(config.n_embd, bias=config.bias),
        ))
        # replacement routing: the output is itself a read of all sources
        if config.residual == "attnres":
            self.transformer.final_router = make_router(config, config.n_sublayers)
        # in sublayer order, final last
        self.routers = [m for m in self.modules() if isinstance(m, Router)]
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # with weight tying when using torch.compile() some warnings get generated:
        # "UserWarning: functional_call was passed multiple values for tied weights.
        # This behavior is deprecated and will be an error in future versions"
        # not 100% sure what this is, so far seems to be harmless. TODO investigate
        self.transformer.wte.weight = self.lm_head.weight # https://paperswithcode.com/method/weight-tying

        # init all weights
        self._init_weights()

    def get_num_params(self, non_embedding=True):
        """
        Return the number of parameters in the model.
        For non-embedding count (default), the position embeddings get subtracted.
        The token embeddings would too, except due to the parameter sharing these
        params are actually used as weights in the final layer, so we include them.
        """
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def _init_weights(self):
        """Every init in one place: GPT-2's normal(0.02), with the residual projections (c_proj)
        scaled by 1/sqrt(2*n_layer) per the GPT-2 paper; routers at zero query and unit gain
        (uniform routing)."""
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj") else 0.02
                torch.nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, Router) and module.static:
                torch.nn.init.zeros_(module.logits)
            elif isinstance(module, Router):
                torch.nn.init.zeros_(module.query)
                torch.nn.init.ones_(module.norm.weight)

    def hidden(self, idx, cache=None, record=None):
        """Token ids (B, T) -> final hidden states ln_f(output) (B, T, D).
        cache: a KVCache per layer, filled and extended by generation.
        record: a list that collects every router's (sources, alpha (B, T, H, n)), in order,
        for routing statistics."""
        device = idx.device
        b, t = idx.size()
        past = len(cache[0]) if cache else 0
        if past + t > self.config.block_size:
            raise ValueError(f"Cannot forward sequence of length {past + t}, "
                             f"block size is only {self.config.block_size}; "
                             f"crop the input to the last block_size tokens")
        pos = torch.arange(past, past + t, dtype=torch.long, device=device) # shape (t)

        # forward the GPT model itself
        tok_emb = self.transformer.wte(idx) # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos) # position embeddings of shape (t, n_embd)
        e = self.transformer.drop(tok_emb + pos_emb)
        # the same numbers, computed the fast way (the file's last section)
        if self.config.fast_routing:
            stream = FastStream(e, self.config, self.routers, record)
        else:
            stream = Stream(e, self.config, record)
        for block, kv in zip(self.transformer.h, cache or [None] * len(self.transformer.h)):
            block(stream, kv)
        return self.transformer.ln_f(stream.output(getattr(self.transformer, "final_router", None)))

    def forward(self, idx, targets=None):
        """idx (B, T) token ids -> (logits (B, T, vocab), loss or None).
        Unlike nanoGPT, logits cover every position also without targets (tests and reports use
        them); generate() projects only the last position."""
        x = self.hidden(idx)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def crop_block_size(self, block_size):
        # model surgery to decrease the block size if necessary
        # e.g. we may load the GPT2 pretrained model checkpoint (block size 1024)
        # but want to use a smaller block size for some smaller, simpler model
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    @classmethod
    def from_pretrained(cls, model_type, override_args=None):
        """HF GPT-2 weights (gpt2, gpt2-medium, gpt2-large, gpt2-xl) into any residual mode; routing
        starts at zero init, so the routed modes that are exact at init reproduce GPT-2. Needs
        `transformers` and the internet (or its local cache)."""
        if model_type not in GPT2_MODELS:
            raise ValueError(f"unknown GPT-2 model {model_type!r}; "
                             f"choose one of {', '.join(GPT2_MODELS)}")
        override_args = dict(override_args or {})
        allowed = {"dropout", "residual", *ROUTING_FIELDS, "fast_routing"}
        if set(override_args) - allowed:
            raise ValueError(f"from_pretrained can override only {', '.join(sorted(allowed))}")
        try:
            from transformers import GPT2LMHeadModel
        except ImportError:
            raise ValueError("loading GPT-2 weights needs the transformers package: "
                             "pip install transformers") from None
        try:
            model_hf = GPT2LMHeadModel.from_pretrained(model_type)
        except OSError as e:
            raise ValueError(f"could not fetch {model_type} from the Hugging Face hub: it needs "
                             f"the internet or a local cache ({str(e).splitlines()[0]})") from None
        print(f"loading weights from pretrained gpt: {model_type}")
        # n_layer, n_head and n_embd are determined from model_type
        config_args = dict(GPT2_MODELS[model_type])
        # always for GPT model checkpoints
        config_args.update(vocab_size=50257, block_size=1024, bias=True)
        config_args.update(override_args)
        return cls.from_hf_state_dict(model_hf.state_dict(), GPTConfig(**config_args))

    @classmethod
    def from_hf_state_dict(cls, sd_hf, config):
        """Build a model of `config` from a Hugging Face GPT2LMHeadModel state_dict (the offline
        part of from_pretrained): every key but the routing ones comes from sd_hf; routing stays at
        zero init."""
        model = GPT(config)
        sd = model.state_dict()
        # the HF checkpoint's keys are ours minus the routing keys; drop its attention mask buffers
        sd_hf = {k: v for k, v in sd_hf.items()
                 if not k.endswith(('.attn.masked_bias', '.attn.bias'))}
        expected = [k for k in sd if not is_routing_key(k)]
        assert len(sd_hf) == len(expected), f"mismatched keys: {len(sd_hf)} != {len(expected)}"
        # HF uses Conv1D modules (weights transposed against nn.Linear) for these
        transposed = ['attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight']
        with torch.no_grad():
            for k in expected:
                w = sd_hf[k].t() if any(k.endswith(t) for t in transposed) else sd_hf[k]
                assert w.shape == sd[k].shape, f"shape mismatch for {k}: {w.shape} vs {sd[k].shape}"
                sd[k].copy_(w)
        return model

    def route_parameters(self):
        """The routing parameters (pseudo-queries and key gains): empty for baseline."""
        return [p for router in self.routers for p in router.parameters()]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type,
                             route_lr_mult=1.0):
        """AdamW with three groups: 2-D weights decay; biases and norms don't; routing parameters
        have no decay and lr = learning_rate * route_lr_mult. Each group carries 'lr_mult' for the
        schedule."""
        route = {id(p) for p in self.route_parameters()}
        params = [p for p in self.parameters() if p.requires_grad]  # tied weights appear once
        decay = [p for p in params if p.dim() >= 2 and id(p) not in route]
        nodecay = [p for p in params if p.dim() < 2 and id(p) not in route]
        routing = [p for p in params if id(p) in route]
        optim_groups = [
            {'params': decay, 'weight_decay': weight_decay, 'lr_mult': 1.0, 'name': 'decay'},
            {'params': nodecay, 'weight_decay': 0.0, 'lr_mult': 1.0, 'name': 'no_decay'},
        ]
        if routing:
            optim_groups.append({'params': routing, 'weight_decay': 0.0, 'lr_mult': route_lr_mult,
                                 'name': 'routing'})
        for group in optim_groups:
            group['lr'] = learning_rate * group['lr_mult']
        # Create AdamW optimizer and use the fused version if it is available
        fused_available = 'fused' in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == 'cuda'
        extra_args = dict(fused=True) if use_fused else dict()
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)
        return optimizer

    def flops_per_token(self):
        """Forward+backward FLOPs per token: nanoGPT's 6N + 12*L*H*Q*T (PaLM appendix B), plus
        routing: each router reads n sources with a D-dim dot product and a D-dim weighted sum."""
        N = self.get_num_params()
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd//cfg.n_head, cfg.block_size
        flops = 6*N + 12*L*H*Q*T
        # the weighted sum; dynamic adds the key's dot product
        per_source = 2 if cfg.route_weights == "static" else 4
        return flops + 3 * per_source * cfg.n_embd * sum(self.sources_per_router())

    def sources_per_router(self):
        return sources_per_router(self.config)

    def estimate_mfu(self, fwdbwd_per_iter, dt, device=None):
        """Model FLOPs utilization against the device's bf16 peak (A100 312e12; H100/H200 989e12).
        Returns None for any other device (CPU included): then report tokens/s only."""
        device = device or next(self.parameters()).device
        peak = device_peak_flops(device)
        if peak is None:
            return None
        flops_per_iter = self.flops_per_token() * self.config.block_size * fwdbwd_per_iter
        return flops_per_iter * (1.0/dt) / peak

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True,
                 generator=None):
        """
        Take a conditioning sequence of indices idx (LongTensor of shape (b,t)) and complete
        the sequence max_new_tokens times, feeding the predictions back into the model each time.
        With use_cache the keys and values of earlier positions are kept, so each step runs only the
        new token (routing is per token, so nothing else needs caching); the result equals
        use_cache=False. Past block_size the context is cropped as in nanoGPT, and the cache is
        rebuilt for the window. temperature 0 means greedy (argmax). Most likely you'll want to make
        sure to be in model.eval().
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy)")
        if top_k is not None and not 1 <= top_k <= self.config.vocab_size:
            raise ValueError(f"top_k={top_k} must be between 1 and the vocabulary size "
                             f"{self.config.vocab_size}")
        block_size = self.config.block_size
        cache, done = None, 0  # done: how many of idx's tokens the cache holds
        for _ in range(max_new_tokens):
            if not use_cache or idx.size(1) > block_size or cache is None:
                # if the sequence context is growing too long we must crop it at block_size;
                # absolute positions then shift, so the window is recomputed (and cached afresh)
                idx_cond = idx if idx.size(1) <= block_size else idx[:, -block_size:]
                cache = [KVCache() for _ in self.transformer.h] if use_cache else None
                x = self.hidden(idx_cond, cache)
            else:
                x = self.hidden(idx[:, done:], cache)
            done = idx.size(1)
            # pluck the logits at the final step and scale by desired temperature
            logits = self.lm_head(x[:, -1, :]).float()
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                # optionally crop the logits to only the top k options
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float('Inf')
                # apply softmax to convert logits to (normalized) probabilities
                probs = F.softmax(logits, dim=-1)
                # sample from the distribution
                idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
            # append sampled index to the running sequence and continue
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


PEAK_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core peaks


# -----------------------------------------------------------------------------
# the checks of GPTConfig: one clear ValueError naming the field, its value and what to choose

def check_gpt_config(c):
    if c.residual not in RESIDUALS:
        raise ValueError(f"residual={c.residual!r} is unknown; "
                         f"choose one of {', '.join(RESIDUALS)}")
    for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
        if not isinstance(getattr(c, name), int) or getattr(c, name) < 1:
            raise ValueError(f"{name}={getattr(c, name)!r} must be a positive integer")
    if c.fast_routing not in (True, False):
        raise ValueError(f"fast_routing={c.fast_routing!r} must be True or False")
    if not 0.0 <= c.dropout < 1.0:
        raise ValueError(f"dropout={c.dropout!r} must be in [0, 1)")
    if c.n_embd % c.n_head != 0:
        raise ValueError(f"n_embd={c.n_embd} is not divisible by n_head={c.n_head}; "
                         f"choose n_head among {divisors(c.n_embd)}")
    for name in ROUTING_FIELDS:
        if c.residual == "baseline" and getattr(c, name) is not None:
            raise ValueError(f"{name} is set but residual='baseline' has no routing; "
                             f"leave {name} unset or choose attnres, delta or delta_block")


def check_routing(c, defaulted):
    """The routing fields of a routed mode, its defaults filled in
    (the fields named in `defaulted`)."""
    if c.route_sources not in ROUTE_SOURCES:
        raise ValueError(f"route_sources={c.route_sources!r} is unknown; "
                         f"choose one of {', '.join(ROUTE_SOURCES)}")
    if c.route_weights not in ROUTE_WEIGHTS:
        raise ValueError(f"route_weights={c.route_weights!r} is unknown; "
                         f"choose one of {', '.join(ROUTE_WEIGHTS)}")
    H, N, S = c.route_heads, c.n_route_blocks, c.n_sublayers
    if isinstance(H, bool) or not isinstance(H, int) or H < 1 or c.n_embd % H != 0:
        raise ValueError(f"route_heads={H!r} must be a whole number that divides "
                         f"n_embd={c.n_embd}; choose one of {divisors(c.n_embd)}")
    if isinstance(N, bool) or not isinstance(N, int) or N < 1 or S % N != 0:
        if "n_route_blocks" in defaulted:
            said = f"n_route_blocks={N!r} (the default for this mode)"
        else:
            said = f"n_route_blocks={N!r}"
        raise ValueError(f"{said} must divide 2*n_layer={S} sublayers; choose one of {divisors(S)}")
    if c.residual == "delta" and N != S:
        raise ValueError(f"n_route_blocks={N} but residual='delta' routes per sublayer "
                         f"(n_route_blocks=2*n_layer={S}); "
                         f"leave it unset, or use residual='delta_block' for {N} blocks")
    if c.route_partial not in (True, False):
        raise ValueError(f"route_partial={c.route_partial!r} must be True or False")
    if c.residual == "attnres" and not c.route_partial:
        raise ValueError("route_partial=False but attnres always routes the current partial block "
                         "(Kimi's definition); leave it unset or use delta_block")


def divisors(n):
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def device_peak_flops(device):
    """The bf16 peak FLOP/s of a CUDA device from PEAK_FLOPS, or None when unknown
    (CPU, MPS, other GPUs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


def is_routing_key(name):
    """True for the state_dict keys of the routers (attn_router, mlp_router, final_router)."""
    return "_router." in name


# ================================================================================================
# The fast path for routing (GPTConfig.fast_routing: every preset's but cpu's). The same numbers as
# Router and Stream above up to float rounding (tests/test_model.py holds them equal, gradients
# included), with activation memory linear in depth and few passes over memory. A first reading
# can skip this section.
#
# Router above forms each source's keys, and autograd keeps them, per sublayer: O(S^2 * B*T*D)
# floats over the model. Here instead (Kimi's two-phase computation, on the CPU):
#  - w . RMSNorm_g(s) = ((w * g) . s) / rms(s): a source enters the logits only through its score
#    against the folded query q = w * g; the keys are never formed.
#  - Phase 1: a completed block is scored once, at the first read after it is born, against every
#    router still to read it, in one product (Score); each of those routers takes its row.
#  - Phase 2: the current block's partial sum changes at every sublayer and only one router reads
#    it, so RouteRead scores it against that router's query, then takes the softmax and the weighted
#    sum (added straight onto x in the additive modes), looping over the sources in place and saving
#    only references to them (alive anyway) and alpha.
#  - Each block is handed on from router to router as an alias, so its routing gradient is one
#    tensor that each router adds its share into in place (see RouteRead).
# ================================================================================================

class FastStream(Stream):
    """Stream with the same reads and writes, routed with Score and RouteRead.
    The routers are read in the model's order (sublayers, then attnres's final router): router j's
    folded query is row j."""

    def __init__(self, e, config, routers, record=None):
        super().__init__(e, config, record)
        self.routers, self.heads = routers, config.route_heads
        self.static = config.route_weights == "static"  # static logits need no scores
        self.queries = folded_queries(routers) if routers and not self.static else None  # (R, D)
        # per block: its logits (B, T, H) for each router from its first reader on
        self.scores = []
        self.handed_on = []  # the blocks, as the last router handed them on
        self.reads = 0       # routers read so far

    def read(self, router):
        if router is None:
            return self.x
        assert router is self.routers[self.reads], "routers must be read in the model's order"
        j, self.reads = self.reads, self.reads + 1
        for s in self.blocks[len(self.handed_on):]:  # the blocks completed since the last read
            self.handed_on.append(s)
            # phase 1: scored once, in one product, against this router and every later one
            if not self.static:
                self.scores.append([None] * j + list(Score.apply(s, self.queries[j:], self.heads)))
        sources = self.sources()
        partial = sources[len(self.blocks):]  # [p] when the partial sum is routed, else []
        if self.static:  # one logit per source, the same for every token
            # (n, 1, 1, H)
            logits = upcast(router.logits).t()[:, None, None, :]
            logits, query = logits.expand(-1, *sources[0].shape[:2], -1), None  # (n, B, T, H)
        else:
            # the blocks' logits from phase 1;
            # the partial's, if routed, RouteRead computes (phase 2)
            logits = torch.stack([scores[j] for scores in self.scores])
            query = self.queries[j] if partial else None
        base = self.x if self.keeps_stream else None
        if len(sources) == 1:  # alpha = 1 whatever the logit: the read is the source itself
            alpha = torch.ones_like(logits).movedim(0, -1)  # (B, T, H, 1)
            u = sources[0] if base is None else base + sources[0]
        else:
            # Dynamo cannot trace the aliases (nor needs them)
            hand_on = not torch.compiler.is_compiling()
            u, alpha, *handed_on = RouteRead.apply(hand_on, base, logits, query,
                                                   *self.handed_on, *partial)
            alpha = alpha.movedim(0, -1)
            if handed_on:
                # a partial is read once: not handed on
                self.handed_on = handed_on[:len(self.blocks)]
        # the sources themselves: the aliases stay inside the router chain
        if self.record is not None:
            self.record.append((sources, alpha))  # alpha (B, T, H, n)
        return u


class RouteRead(torch.autograd.Function):
    """base + sum_i alpha_i s_i with alpha = softmax_i(logits); base None or x (B, T, D).
    logits (n, B, T, H) holds every source's logit, or, with a query q (D,), every source's but the
    last, a partial sum p, which is scored here: (q . p) / rms(p) per head (phase 2). With H heads,
    alpha_i's head h weighs channel group h of s_i (H = 1: all channels).

    Forward and backward loop over the sources in place instead of stacking copies of them, and only
    references to the sources (alive anyway) and alpha (n, B, T, H) are saved: activation memory
    stays linear in depth. Softmax and sum run in float32 (float64 for a float64 model).

    With hand_on, each source but a scored partial is also returned, as an alias, for the next
    router, its only consumer: the gradient that comes back for an alias is the sum of the later
    routers' alpha_i * g (a tensor only this chain holds), and this router adds its own share into
    it in place. So each source's routing gradient is one tensor accumulated along the chain of
    routers: one multiply-add pass per (router, source) pair, where autograd would make a new
    product tensor and then add it. Under torch.compile (hand_on=False) the aliases are left out and
    autograd sums as usual.
    """

    @staticmethod
    def forward(ctx, hand_on, base, logits, query, *sources):
        H = logits.size(-1)
        scored = ()
        # phase 2: the partial p (the last source) scored against this router's query
        if query is not None:
            q = query.view(H, -1)                   # (H, D/H): head h's query q_h
            r = inv_rms(sources[-1]).unsqueeze(-1)  # 1 / rms(p), (B, T, 1)
            logit = (upcast(sources[-1]).unflatten(-1, (H, -1)) * q).sum(-1).mul_(r)  # (B, T, H)
            logits = torch.cat([logits, logit.unsqueeze(0)])
            scored = (q, r, logit)
        # (n, B, T, H); over a leading dim: PyTorch's faster kernel for small n
        alpha = logits.softmax(dim=0)
        a = alpha.unsqueeze(-1).unbind(0)  # n views alpha_i, (B, T, H, 1)
        # (B, T, H, D/H): head h reads channel group h
        s0 = upcast(sources[0]).unflatten(-1, (H, -1))
        if base is None:
            read = a[0] * s0
        else:
            read = torch.addcmul(upcast(base).unflatten(-1, (H, -1)), a[0], s0)
        for a_i, s in zip(a[1:], sources[1:]):
            read.addcmul_(a_i, s.unflatten(-1, (H, -1)))
        read = read.flatten(-2)
        ctx.save_for_backward(alpha, *scored, *sources)
        ctx.mark_non_differentiable(alpha)
        ctx.set_materialize_grads(False)
        ctx.scored = bool(scored)
        if base is None:
            dtype = sources[0].dtype
        else:
            dtype = torch.promote_types(base.dtype, sources[0].dtype)
        handed_on = sources[:-1] if scored else sources
        # a source returned as it is comes out as an alias of it (autograd makes the view)
        return (read if read.dtype == dtype else read.to(dtype), alpha,
                *(handed_on if hand_on else ()))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, _, *handed_on_grads):
        alpha, *sources = ctx.saved_tensors
        if ctx.scored:
            q, r, logit = sources[:3]
            sources = sources[3:]
        else:
            q, r, logit = (None,) * 3
        # later routers' gradients
        later = list(handed_on_grads) + [None] * (len(sources) - len(handed_on_grads))
        if grad is None:  # the read itself was not used: only the handed-on gradients pass through
            return (None, None, None, None, *later)
        g_base = grad if ctx.needs_input_grad[1] else None
        H = alpha.size(-1)
        g = upcast(grad).unflatten(-1, (H, -1))   # (B, T, H, D/H)
        g_alpha = torch.empty_like(alpha)         # g . s_i per head, (n, B, T, H)
        prod = torch.empty_like(g)                # one buffer for the products g * s_i
        g_sources = []
        for a_i, g_alpha_i, s, g_later in zip(alpha.unsqueeze(-1).unbind(0), g_alpha.unbind(0),
                                              sources, later):
            torch.sum(torch.mul(g, s.unflatten(-1, (H, -1)), out=prod), dim=-1, out=g_alpha_i)
            if g_later is None:
                g_sources.append(a_i * g)
            else:
                # the later routers' gradient is a dense tensor of this chain's own:
                # add this router's share in place
                g_sources.append(g_later.unflatten(-1, (H, -1)).addcmul_(a_i, g))
        g_logits = alpha * (g_alpha - (alpha * g_alpha).sum(0))  # softmax backward
        g_query = None
        # the partial's logit r (q_h . p_h) also depends on p through r: dr/dp = -r^3 p / D
        if ctx.scored:
            p, g_logit = upcast(sources[-1]), g_logits[-1]
            g_r = (g_logit * r).unsqueeze(-1)                                    # (B, T, H, 1)
            # (B, T, 1)
            c = (g_logit * logit).sum(-1, keepdim=True).mul_(r.square()).div_(p.size(-1))
            g_sources[-1].addcmul_(g_r, q).flatten(-2).addcmul_(c, p, value=-1)  # += g_r q_h - c p
            g_query = (g_r * p.unflatten(-1, (H, -1))).sum((0, 1)).flatten()    # (D,)
            g_logits = g_logits[:-1]
        g_sources = [g_s.flatten(-2).to(s.dtype) for g_s, s in zip(g_sources, sources)]
        return (None, g_base, g_logits, g_query, *g_sources)


class Score(torch.autograd.Function):
    """Phase 1: a block s's logits for R routers at once, s (B, T, D) against their folded queries
    Q (R, D):
        score_j[h] = (Q[j, h] . s[h]) / rms(s)     for each channel group h, rms over the full width
    returned as R tensors (B, T, H), one per router (H = 1: (Q[j] . s) / rms(s)). Float32 (float64
    for a float64 model), also under autocast; one batched matmul over the heads. The backward,
    written out (dr/ds = -r^3 s / D for r = 1 / rms(s)):
        dL/ds[h] = sum_j (g_jh * r) Q[j, h] - c * s[h],   c = r^2 * sum_{j,h} g_jh score_jh / D
        dL/dQ[j, h] = sum over tokens of (g_jh * r) s[h]
    A bf16 source is saved as it is, not again as a float32 copy.
    """

    @staticmethod
    def forward(ctx, s, Q, heads):
        D, R = s.size(-1), Q.size(0)
        with float32_only(s):
            r = inv_rms(s).view(-1)                                         # 1 / rms(s), (B*T,)
            s_h = upcast(s).view(-1, heads, D // heads).permute(1, 2, 0)    # (H, D/H, B*T)
            Q_h = Q.view(R, heads, D // heads).transpose(0, 1)              # (H, R, D/H)
            scores = torch.bmm(Q_h, s_h).mul_(r)                            # (H, R, B*T)
            # (R, B*T, H): each router's rows together
            scores = scores.permute(1, 2, 0).contiguous()
        ctx.save_for_backward(s, Q, scores, r)
        ctx.set_materialize_grads(False)
        return tuple(scores.unflatten(1, s.shape[:-1]))                     # R tensors (B, T, H)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        s, Q, scores, r = ctx.saved_tensors
        (R, _, H), D = scores.shape, s.size(-1)
        zero = scores.new_zeros(scores.shape[1:])  # a router that read nothing, (B*T, H)
        g = torch.stack([zero if g is None else g.flatten(0, 1) for g in grads])  # (R, B*T, H)
        with float32_only(s):
            gr = g.mul_(r.unsqueeze(-1))                                    # g * r
            c = (gr * scores).sum((0, 2)).mul_(r).div_(D)                   # (B*T,)
            s32 = upcast(s).view(-1, D)
            gr = gr.permute(2, 0, 1)                                        # (H, R, B*T)
            # (H, B*T, D/H)
            g_s = torch.bmm(gr.transpose(1, 2), Q.view(R, H, D // H).transpose(0, 1))
            g_s = g_s.transpose(0, 1).reshape(s32.shape).addcmul_(c.unsqueeze(-1), s32, value=-1)
            g_Q = torch.bmm(gr, s32.view(-1, H, D // H).transpose(0, 1))    # (H, R, D/H)
        return g_s.view(s.shape).to(s.dtype), g_Q.transpose(0, 1).reshape(R, D), None


def inv_rms(s):
    """1 / rms(s) over the last dim, (B, T), in float32 (float64 for a float64 s):
    one pass over s."""
    norm = torch.linalg.vector_norm(s, dim=-1, dtype=torch.promote_types(s.dtype, torch.float32))
    return norm.square_().div_(s.size(-1)).add_(ROUTE_EPS).rsqrt_()


def float32_only(t):
    """Autocast off (for the routing math in float32) when it is on;
    else nothing, which is cheaper."""
    if torch.is_autocast_enabled(t.device.type):
        return torch.autocast(t.device.type, enabled=False)
    return contextlib.nullcontext()


def folded_queries(routers):
    """Every router's folded query w * g, (R, D) in float32: one product for all of them."""
    return (upcast(torch.stack([r.query for r in routers]))
            * upcast(torch.stack([r.norm.weight for r in routers])))
