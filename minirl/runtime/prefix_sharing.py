"""Computing each group's shared prompt once in the update, and micro-batches of similar length.

The G completions of a GRPO group all begin with the same prompt. `shared_prefix_logits` runs
the B distinct prompts once with a KV cache, repeats the cache G times and runs the N = B * G
completions against it: the same logits as one forward pass over every row (up to float
rounding) and the same gradients (backpropagation sums the G copies' gradients into the one
prompt pass), for about 1/G of the prompt's compute. `minirl.algo.logprobs.completion_logits`
takes this path when it is given `num_generations=G`.

For a long-tailed batch the update runs in micro-batches of rows of similar completion length
(`micro_batches`, at most `max_tokens_per_microbatch` completion tokens each), each padded only
to its own longest completion. `MicroBatchedLogprobs` scores a Rollout that way, with every
group's prompt still computed once for all micro-batches (`PromptCache`): the update then costs
about the real tokens, not rows x the longest completion. Notebook 01 (section 10) measures both
savings; the actor (`minirl.roles.actor`) runs every update through `MicroBatchedLogprobs`.

Hand-written (a speed-up the lesson measures but does not build). Simplified vs TRL: micro-batches
are sized by tokens and grouped by length rather than fixed row counts; needs a model whose cache
is an HF DynamicCache (`batch_repeat_interleave`, `.layers[i].keys / .values`).
"""
import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from minirl.algo.logprobs import completion_logits, entropy_from_logits, position_ids_from_mask, selective_log_softmax
from minirl.data import Rollout

# the forward argument and output field holding the KV cache: `cache` since transformers 5.2x
CACHE_ARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def group_prompts(prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int) -> tuple[Tensor, Tensor]:
    """Each group's prompt once: rows 0, G, 2G, ... of prompt_ids, prompt_mask [N, P] -> [B, P] each.

    Raises ValueError if N is not a multiple of G or if the rows of a group have different
    prompts (ids or mask): a Rollout's layout, G consecutive completions per prompt, is required.
    """
    (N, P), G = prompt_ids.shape, num_generations
    if N % G:
        raise ValueError(f"shared_prefix_logits: {N} rows are not groups of num_generations={G}; pass "
                         "B * num_generations rows, or num_generations=1 (no sharing)")
    firsts = prompt_ids[::G], prompt_mask[::G]                                            # [B, P] each
    for name, full, first in zip(("input_ids", "attention_mask"), (prompt_ids, prompt_mask), firsts, strict=True):
        if not torch.equal(full.view(-1, G, P), first[:, None].expand(-1, G, P)):
            raise ValueError(f"completion_logprobs: num_generations={G} but the rows of a group have different "
                             f"prompts ({name} differs in the first {P} columns): pass G consecutive completions "
                             "per prompt (a Rollout's order), or num_generations=1")
    return firsts


def shared_prefix_logits(model, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int,
                         num_generations: int) -> Tensor:
    """The logits that predict the last C tokens, computing each group's shared prompt once.

    input_ids, attention_mask: [N, P+C], N = B * G rows in groups of G = num_generations
    consecutive rows that have the same prompt (identical first P columns of ids and mask, as
    a Rollout lays them out); prompts left-padded, completions right-padded.
    Returns logits [N, C, V] in the model's dtype, where [:, t] predicts completion token t:
    the same values (up to float rounding) and gradients as the rows' logits[:, P-1:-1] from
    one forward pass with position ids from the mask, for about 1/G of the prompt's compute.
    Needs a model whose cache supports `batch_repeat_interleave` (HF DynamicCache).
    Raises ValueError if N is not a multiple of G, if there is no prompt column, or if the rows
    of a group have different prompts.
    """
    T, G, C = input_ids.shape[1], num_generations, num_completion_tokens
    P = T - C
    if P < 1 or C < 1:
        raise ValueError(f"shared_prefix_logits: num_completion_tokens={C} leaves no prompt/completion in "
                         f"{T} columns; need 1 <= num_completion_tokens < {T}")
    prompt_ids, prompt_mask = group_prompts(input_ids[:, :P], attention_mask[:, :P], G)   # [B, P]
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids_from_mask(prompt_mask),
                use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1:].repeat_interleave(G, 0)                                    # [N, 1, V]
    if C == 1:
        return first
    cache = getattr(out, CACHE_ARG)
    cache.batch_repeat_interleave(G)                                                      # [B, ...] -> [N, ...]
    positions = position_ids_from_mask(attention_mask)[:, P:-1]                           # [N, C-1]
    rest = model(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1], position_ids=positions,
                 use_cache=False, **{CACHE_ARG: cache}).logits                            # [N, C-1, V]
    return torch.cat([first, rest], 1)                                                    # [N, C, V]


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Rows grouped by completion length into micro-batches of at most `max_tokens` padded completion tokens.

    lengths[i]: row i's completion tokens (the sum of its mask). Rows are taken longest first;
    a micro-batch is as wide as its first row and takes the next rows while rows x width stays
    within max_tokens, so each is padded only to its own longest completion. A row longer than
    max_tokens gets a micro-batch of its own. max_tokens=0: one micro-batch of every row (the
    padded path). Returns each micro-batch's row indices in ascending order; ties are broken by
    index, so the plan is deterministic.
    """
    if max_tokens < 0:
        raise ValueError(f"micro_batches: max_tokens={max_tokens} must be >= 0 (0: one micro-batch)")
    if max_tokens == 0:
        return [list(range(len(lengths)))]
    batches, width = [], 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if batches and (len(batches[-1]) + 1) * width <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
            width = max(lengths[i], 1)
    return [sorted(rows) for rows in batches]


class PromptCache:
    """Each group's prompt run once for a batch scored in micro-batches; its outputs are leaves that collect gradient.

    prompt_ids, prompt_mask: [B, P], each group's prompt once (a Rollout's rows 0, G, 2G, ...).
    The prompt pass runs without gradient. Every layer's keys and values ([B, kv_heads, P, d])
    and the logits at the last position ([B, 1, V]) are kept as leaves (requires_grad when
    `requires_grad`). `logits` scores rows against them; `backward` runs the pass again with
    gradient and backpropagates what the micro-batches' backward passes left in the leaves'
    .grad. Assumes a deterministic forward (no dropout, as in Qwen2 and Llama) and an HF
    DynamicCache (`.layers[i].keys / .values`).
    """

    def __init__(self, model, prompt_ids: Tensor, prompt_mask: Tensor, requires_grad: bool = True):
        self.model, self.prompt_ids, self.prompt_mask = model, prompt_ids, prompt_mask
        with torch.no_grad():
            last, kv = self._run()
        self.last = last.requires_grad_(requires_grad)                                    # [B, 1, V]
        self.kv = [(k.requires_grad_(requires_grad), v.requires_grad_(requires_grad)) for k, v in kv]

    def _run(self):
        out = self.model(input_ids=self.prompt_ids, attention_mask=self.prompt_mask, use_cache=True,
                         position_ids=position_ids_from_mask(self.prompt_mask), logits_to_keep=1)
        return out.logits[:, -1:], [(layer.keys, layer.values) for layer in getattr(out, CACHE_ARG).layers]

    def logits(self, input_ids: Tensor, attention_mask: Tensor, prompt_of: Tensor,
               num_completion_tokens: int) -> Tensor:
        """The logits predicting the last C tokens of n rows, row i continuing prompt `prompt_of[i]`.

        input_ids, attention_mask: [n, P+C] (the rows' prompt columns, then C completion columns);
        prompt_of: [n] long in [0, B). Returns [n, C, V] in the model's dtype, as shared_prefix_logits.
        """
        P, C = self.prompt_ids.shape[1], num_completion_tokens
        first = self.last[prompt_of]                                                      # [n, 1, V]
        if C == 1:
            return first
        cache = DynamicCache(ddp_cache_data=[(k[prompt_of], v[prompt_of]) for k, v in self.kv])   # [n, ...]
        rest = self.model(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1], use_cache=False,
                          position_ids=position_ids_from_mask(attention_mask)[:, P:-1],
                          **{CACHE_ARG: cache}).logits                                    # [n, C-1, V]
        return torch.cat([first, rest], 1)                                                # [n, C, V]

    def backward(self) -> None:
        """The prompt pass again, with gradient, backpropagating the gradient the micro-batches left on its outputs."""
        leaves = [self.last] + [t for pair in self.kv for t in pair]
        if all(t.grad is None for t in leaves):
            return                                                                        # no backward ran
        last, kv = self._run()
        outputs = [last] + [t for pair in kv for t in pair]
        pairs = [(out, leaf.grad) for out, leaf in zip(outputs, leaves, strict=True) if leaf.grad is not None]
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


class MicroBatchedLogprobs:
    """The log-probs of a Rollout's completions, one micro-batch (a list of rows, from `micro_batches`) at a time.

    `self(k)` returns micro-batch k's (logps [n_k, w_k] float32, entropy or None), w_k its width:
    its longest completion, at least 2 columns when the prompt is shared (so that every
    micro-batch makes one completion pass, whatever its rows), at most the rollout's C.
    Its prompts are computed:
      - without sharing (share_prompt False or num_generations 1): with each row, one pass;
      - sharing, one micro-batch of every row: `shared_prefix_logits` over the whole batch;
      - sharing, several micro-batches: once for all of them (`PromptCache`, made at the first
        call); then call `backward()` after the micro-batches' backward passes.
    Values equal one pass over the padded batch up to float rounding; so do the gradients.
    """

    def __init__(self, model, rollout: Rollout, plan: list[list[int]], temperature: float = 1.0,
                 share_prompt: bool = True, requires_grad: bool = True):
        if temperature <= 0:
            raise ValueError(f"MicroBatchedLogprobs: temperature={temperature} must be > 0")
        self.model, self.rollout, self.temperature, self.requires_grad = model, rollout, temperature, requires_grad
        self.share = share_prompt and rollout.num_generations > 1
        self.ids, self.mask = rollout.input_ids, rollout.attention_mask                          # [N, P+C]
        lengths, C = rollout.completion_mask.sum(1), rollout.num_completion_tokens                 # [N]
        device = rollout.completion_ids.device
        self.rows = [torch.as_tensor(rows, dtype=torch.long, device=device) for rows in plan]
        self.widths = [min(C, max(int(lengths[rows].max()), 2 if self.share else 1)) for rows in self.rows]
        self.prompts = None

    def __len__(self) -> int:
        return len(self.rows)

    def tokens(self) -> int:
        """Completion tokens the micro-batches compute, padding included: sum of rows x width."""
        return sum(len(rows) * width for rows, width in zip(self.rows, self.widths, strict=True))

    def __call__(self, k: int, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        ro, rows, w = self.rollout, self.rows[k], self.widths[k]
        P, G = ro.prompt_ids.shape[1], ro.num_generations
        ids, mask = self.ids[rows, :P + w], self.mask[rows, :P + w]                             # [n, P+w]
        if self.share and len(self.rows) > 1:
            if self.prompts is None:
                self.prompts = PromptCache(self.model, *group_prompts(ro.prompt_ids, ro.prompt_mask, G),
                                           self.requires_grad)
            logits = self.prompts.logits(ids, mask, rows // G, w).float() / self.temperature   # [n, w, V]
        else:
            logits = completion_logits(self.model, ids, mask, w, self.temperature, G if self.share else 1)
        logps = selective_log_softmax(logits, ids[:, -w:])                                      # [n, w]
        return logps, (entropy_from_logits(logits) if with_entropy else None)

    def backward(self) -> None:
        """With a PromptCache: backpropagate through the prompts what the micro-batches' backward passes left."""
        if self.prompts is not None:
            self.prompts.backward()

