"""What writes a teacher's shards, by its family's distill_kind (the manifest's `kind`): an encoder-decoder
teacher re-translates source sentences, a decoder-only one answers prompts itself."""

from __future__ import annotations

import logging
import os
import time

from bpd_train.data.distilled import DistillError, write_shard
from bpd_train.distillation.workers import Worker

log = logging.getLogger("bpd_train.distillation.job")

_TEST_SHARD_DELAY = float(os.environ.get("BPD_DISTILL_TEST_SHARD_DELAY", "0") or 0)


def _translation_shards(job, worker: Worker, todo: list[dict], model, stats: dict, device, amp) -> None:
    """An encoder-decoder teacher re-translates each shard's source sentences with beam search (greedy when
    beam_size is 1) and writes {id, translation, teacher_ids, teacher_score, gold} records."""
    from tqdm.auto import tqdm

    from bpd_train.decoding.batched import translate_ids

    d, m = job.cfg.distill, job.manifest
    sp = job.teacher.tokenizer()
    eos = model.config.eos_id
    specials = {model.config.pad_id, model.config.bos_id, eos}
    max_src = model.config.max_positions - 1  # room for eos; longer sources are cut (and counted)
    src_lang, tgt_lang = m["src_lang"], m["tgt_lang"]
    bar = tqdm(
        total=sum(s["num_examples"] for s in todo),
        unit="sent",
        desc=f"distill w{worker.index}",
        disable=not d.get("progress", True),
        dynamic_ncols=True,
        mininterval=1.0,
    )
    cut = 0
    for shard in todo:
        rows = job.dataset[shard["start"] : shard["stop"]]
        srcs = [t[src_lang] for t in rows["translation"]]
        golds = [t[tgt_lang] for t in rows["translation"]]
        ids = [str(i) for i in rows["id"]] if "id" in rows else [str(i) for i in range(shard["start"], shard["stop"])]
        pieces = sp.encode(srcs)
        cut += sum(len(p) > max_src for p in pieces)
        sources = [p[:max_src] + [eos] for p in pieces]
        ts = time.perf_counter()
        hyps = translate_ids(
            model,
            sources,
            beam_size=int(m["beam_size"]),
            length_penalty=float(m["length_penalty"]),
            max_len=m["max_len"],
            max_tokens=int(d.max_tokens),
            max_sentences=int(d.max_sentences),
            device=device,
            progress=bar,
            amp_dtype=amp,
        )
        records = [
            {
                "id": i,
                "translation": {src_lang: s, tgt_lang: sp.decode([t for t in toks if t not in specials])},
                "teacher_ids": toks,
                "teacher_score": score,
                "gold": g,
            }
            for i, s, g, (toks, score) in zip(ids, srcs, golds, hyps)
        ]
        write_shard(job.out_dir / shard["file"], records)
        dt = time.perf_counter() - ts
        if _TEST_SHARD_DELAY:  # lets the kill-and-resume test stop a run between shards reliably
            time.sleep(_TEST_SHARD_DELAY)
        stats["decoded_shards"] += 1
        stats["sentences"] += len(records)
        log.info(
            "%s: wrote %s (%d sentences, %.1f sentences/s)",
            worker,
            shard["file"],
            len(records),
            len(records) / max(dt, 1e-9),
        )
    bar.close()
    if cut:
        log.warning("%d source(s) were longer than the teacher's %d positions and were cut", cut, max_src + 1)


def _lm_shards(job, worker: Worker, todo: list[dict], model, stats: dict, device=None, amp=None) -> None:
    """A decoder-only teacher answers each shard's prompts itself (distillation/self_lm.py: greedy, or sampled from
    a per-record seed, so a shard redone after a crash is the same) and writes {id, prompt|messages, response,
    teacher_ids, gold} records, which LMDataModule trains on (regime.source=distilled). A prompt the model
    answers with nothing keeps its row (the plan's ids) with response null: counted here, left out by training."""
    from tqdm.auto import tqdm

    from bpd_train.distillation.self_lm import distilled_record, prompt_ids, respond_ids

    d, m = job.cfg.distill, job.manifest
    tok = job.teacher.tokenizer()
    src_lang, tgt_lang = m["src_lang"], m["tgt_lang"]
    bar = tqdm(
        total=sum(s["num_examples"] for s in todo),
        unit="prompt",
        desc=f"distill w{worker.index}",
        disable=not d.get("progress", True),
        dynamic_ncols=True,
        mininterval=1.0,
    )
    empty = cut = 0
    room = model.config.max_positions - 1
    weights = None  # the model's default step weights (fp32)
    if m.get("decode_dtype", "fp32") != "fp32":  # the native engine's step weights in that precision
        from bpd_train.decoding.common import stop_ids
        from bpd_train.decoding.settings import DecodeError, DecodeSettings, decode_options, packed_weights

        try:
            settings = DecodeSettings(dtype=m["decode_dtype"], draft_top_tokens=None, proposal_dtype=None)
            weights = packed_weights(model, decode_options(settings, tok, stop_ids(model), str(device or "cpu")))
        except DecodeError as e:
            raise DistillError(f"distill.dtype={m['decode_dtype']}: {e}") from None
    for shard in todo:
        rows = [job.dataset[i] for i in range(shard["start"], shard["stop"])]
        ids = [str(r["id"]) if r.get("id") is not None else str(shard["start"] + n) for n, r in enumerate(rows)]
        prompts = [
            prompt_ids(r, tok, src_lang=src_lang, tgt_lang=tgt_lang, where=f"record {i}") for r, i in zip(rows, ids)
        ]
        for n, q in enumerate(prompts):  # longer than the context: its oldest tokens go (after BOS), as in training
            if len(q) > room:
                keep = 1 if tok.bos_id is not None and q[0] == tok.bos_id else 0
                prompts[n] = q[:keep] + q[len(q) - room + keep :]
                cut += 1
        ts = time.perf_counter()
        answers = respond_ids(
            model,
            prompts,
            max_len=m["max_len"],
            max_sentences=int(d.max_sentences),
            max_tokens=int(d.max_tokens),
            temperature=float(m.get("temperature") or 0.0),
            seed=int(m.get("seed") or 0),
            record_ids=ids,
            progress=bar,
            weights=weights,
        )
        records = []
        for r, i, a in zip(rows, ids, answers):
            rec = distilled_record(r, a, tok, src_lang=src_lang, tgt_lang=tgt_lang, where=f"record {i}")
            if rec is None:
                empty += 1
                from bpd_train.data.lm.processing import prompt_of

                rec = {"prompt": prompt_of(r, tok, src_lang, tgt_lang, f"record {i}")[0], "response": None}
            records.append({"id": i, **rec, "teacher_ids": a, "gold": _gold(r, tgt_lang)})
        write_shard(job.out_dir / shard["file"], records)
        if _TEST_SHARD_DELAY:
            time.sleep(_TEST_SHARD_DELAY)
        stats["decoded_shards"] += 1
        stats["sentences"] += len(records)
        log.info(
            "%s: wrote %s (%d prompts, %.1f prompts/s)",
            worker,
            shard["file"],
            len(records),
            len(records) / max(time.perf_counter() - ts, 1e-9),
        )
    bar.close()
    if empty:
        log.warning(
            "%d prompt(s) were answered with nothing (EOS at once): kept with response null, which training leaves out",
            empty,
        )
    if cut:
        log.warning(
            "%d prompt(s) were longer than the teacher's %d positions: their oldest tokens were cut", cut, room + 1
        )
    stats["empty_responses"] = empty


SHARD_WRITERS = {"translation": _translation_shards, "lm": _lm_shards}


def _gold(record: dict, tgt_lang: str) -> str | None:
    """The reference response of a record, if it has one (teacher BLEU in the manifest)."""
    if record.get("translation"):
        return record["translation"].get(tgt_lang)
    if record.get("messages"):
        last = record["messages"][-1]
        return last.get("content") if last.get("role") == "assistant" else None
    return record.get("response")
