"""bench_grpo.py's torch peer for the update: TRL 1.16's GRPOTrainer scoring and
differentiating recorded rollouts with its own loss (`compute_loss`), on
transformers' Gemma 3 with the bench model's shapes, bf16 weights, LoRA through
PEFT on every linear layer of every block, gradient checkpointing.

Only the update is timed: the inputs are built as `_generate_and_score_completions`
returns them (left-padded prompts, completions, masks, advantages, the item count),
so nothing is generated. TRL 1.16 scores through its own chunked fused LM head
(`add_fused_lm_head`, log-probs and entropy without `[tokens, V]` logits); its
`use_liger_kernel` no longer brings Liger's fused linear cross-entropy to GRPO
(the trainer turns it off) but Liger's layer kernels (norms, MLP, rotary), which
the `trl-liger` provider adds. On a CUDA device steps are timed with CUDA events
and peak memory is `torch.cuda.max_memory_allocated` (weights included, as MLX's
peak); elsewhere wall time and no memory figure.
"""

import statistics
import tempfile
import time

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def missing(liger=False):
    """Why the torch peer cannot run here (a line), or None when it can."""
    names = ["torch", "transformers", "peft", "trl", "datasets"] + (["liger_kernel"] if liger else [])
    for name in names:
        try:
            __import__(name)
        except Exception as err:  # noqa: BLE001 - any failure to import is a reason
            return f"{name} does not import ({type(err).__name__}: {err})"
    import torch

    if liger and not torch.cuda.is_available():
        return "Liger's kernels need a CUDA device"
    return None


def gemma3_config(overrides, vocab):
    """transformers' Gemma3TextConfig for mlx-lm's gemma3_text ModelArgs `overrides`
    (mlx-lm's defaults where they leave a field out)."""
    from transformers import Gemma3TextConfig

    layers = overrides["num_hidden_layers"]
    pattern = overrides.get("sliding_window_pattern", 6)  # mlx-lm: layer i slides unless (i + 1) % pattern == 0
    return Gemma3TextConfig(
        vocab_size=vocab, hidden_size=overrides["hidden_size"], num_hidden_layers=layers,
        intermediate_size=overrides["intermediate_size"], num_attention_heads=overrides["num_attention_heads"],
        num_key_value_heads=overrides["num_key_value_heads"], head_dim=overrides["head_dim"],
        query_pre_attn_scalar=overrides.get("query_pre_attn_scalar", 256),
        sliding_window=overrides.get("sliding_window", 512),
        layer_types=["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)],
        max_position_embeddings=32768, tie_word_embeddings=True)


def word_tokenizer(vocab):
    """A tokenizer of `vocab` made-up words: the trainer wants one (pad and EOS ids);
    nothing is encoded or decoded in an update."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    words.update({f"w{i}": i for i in range(3, vocab)})
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="<unk>")),
                                   pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left")


def prompt_dataset(rows):
    """A `datasets.Dataset` of `rows` placeholder prompts, which the trainer wants and never
    reads here; made from an Arrow table with a fixed fingerprint, so that `datasets` need
    not hash (pickle) it, which fails with some dill / pyarrow pairs."""
    from datasets import Dataset
    from datasets.table import InMemoryTable

    return Dataset(InMemoryTable.from_pydict({"prompt": ["w3"] * rows}), fingerprint="bench-grpo-prompts")


def build_trainer(overrides, vocab, generations, prompts, completion_length, loss_type, liger=False, seed=0):
    """A GRPOTrainer on a random bf16 Gemma 3 of the bench model's shapes, LoRA rank 16
    (alpha 320: mlx-lm's scale 20) on every linear layer of every block."""
    import torch
    from peft import LoraConfig
    from transformers import Gemma3ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    torch.manual_seed(seed)
    with torch.device("cuda" if cuda else "cpu"):  # initialized where it runs: faster on a GPU
        model = Gemma3ForCausalLM._from_config(gemma3_config(overrides, vocab), dtype=torch.bfloat16,
                                               attn_implementation="sdpa")
    rows = generations * prompts
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-grpo-trl-"), report_to=[], seed=seed,
        per_device_train_batch_size=rows, num_generations=generations, max_completion_length=completion_length,
        loss_type=loss_type, beta=0.0, bf16=cuda, use_cpu=not cuda, gradient_checkpointing=True,
        use_liger_kernel=liger, logging_steps=1, save_strategy="no")
    lora = LoraConfig(r=16, lora_alpha=320, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")

    def no_reward(completions, **kwargs):  # never called: the rewards come recorded
        raise AssertionError("the update does not score completions")

    trainer = GRPOTrainer(model=model, reward_funcs=no_reward, args=args, processing_class=word_tokenizer(vocab),
                          train_dataset=prompt_dataset(rows), peft_config=lora)
    # What Trainer.train() does before its first step.
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer


def trainer_inputs(prompts, completions, rewards, device):
    """The dict `_generate_and_score_completions` returns for recorded rollouts
    (`prompts` [P] token ids, `completions` [P][G] token ids, `rewards` [P][G]),
    on-policy (no old log-probs), beta 0: prompts left-padded, completions
    right-padded, advantages `(r - group mean) / (group std + 1e-4)` (TRL's
    unbiased std, scale_rewards "group")."""
    import torch

    G = len(completions[0])
    P_len = max(len(p) for p in prompts)
    C_len = max(len(c) for cs in completions for c in cs)
    prompt_ids, prompt_mask, comp_ids, comp_mask = [], [], [], []
    for p, cs in zip(prompts, completions):
        for c in cs:
            prompt_ids.append([0] * (P_len - len(p)) + list(p))
            prompt_mask.append([0] * (P_len - len(p)) + [1] * len(p))
            comp_ids.append(list(c) + [0] * (C_len - len(c)))
            comp_mask.append([1] * len(c) + [0] * (C_len - len(c)))
    r = torch.tensor(rewards, dtype=torch.float32, device=device)  # [P, G]
    advantages = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1)
    mask = torch.tensor(comp_mask, dtype=torch.long, device=device)
    assert advantages.numel() == mask.shape[0] == len(prompts) * G
    return {"prompt_ids": torch.tensor(prompt_ids, device=device),
            "prompt_mask": torch.tensor(prompt_mask, dtype=torch.long, device=device),
            "completion_ids": torch.tensor(comp_ids, device=device), "completion_mask": mask,
            "advantages": advantages, "num_items_in_batch": mask.sum()}


def update_step(trainer, inputs):
    """One update as the trainer's training_step runs it after `_prepare_inputs`: the
    loss under its autocast context, backward, the LoRA gradients cleared after."""

    def step():
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(trainer.model, inputs)
        trainer.accelerator.backward(loss)
        trainer.model.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def grad_norm(trainer, inputs):
    """The L2 norm of the LoRA gradients of one more update (not timed): nonzero shows
    that the backward reached the adapters."""
    import torch

    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(trainer.model, inputs)
    trainer.accelerator.backward(loss)
    grads = [p.grad.float() for p in trainer.model.parameters() if p.requires_grad and p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
    trainer.model.zero_grad(set_to_none=True)
    return norm


def measure(step, repeats):
    """(median ms, peak GB or None, warm-up ms, last loss) of `step` after a warm-up."""
    import torch

    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    loss = step()
    first = (time.perf_counter() - t0) * 1e3
    times, peak = [], 0.0
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            peak = max(peak, torch.cuda.max_memory_allocated() / 1e9)
        else:
            t0 = time.perf_counter()
            loss = step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), (peak if cuda else None), first, loss


def release():
    """Give the torch allocator's cached blocks back (MLX runs in the same process)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
