"""CosyVoice-BlankEN: a Qwen2 config plus a byte-level BPE trained offline on a small built-in corpus."""
from __future__ import annotations

import json
from pathlib import Path

from async_cosyvoice.dims_map import qwen_config
from async_cosyvoice.frontend.tokenizer import EOS_TOKEN, SPECIAL_TOKENS, qwen2_pipeline

from .presets import Preset
from .weights import STD

BASE_SPECIALS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")  # in BlankEN's tokenizer_config.json

_CORPUS_EN = """\
The morning train was late again, so I walked along the river and listened to the birds.
Hello! This small voice model was built only for testing, and it should sound like noise.
A quick brown fox jumps over the lazy dog while the quiet cat watches from the window.
Please call Stella and ask her to bring these things with her from the store: six spoons of fresh
snow peas, five thick slabs of blue cheese, and maybe a snack for her brother Bob.
We also need a small plastic snake and a big toy frog for the kids.
When the sunlight strikes raindrops in the air, they act as a prism and form a rainbow.
The rainbow is a division of white light into many beautiful colors.
Streaming speech synthesis returns audio in small chunks, so the listener hears the first words
almost immediately, long before the whole sentence has been generated.
Numbers such as 1, 2, 3, 42, 100, 2024 and 3.14159 appear in weather reports, prices and dates.
It costs $12.50 today; yesterday it was 15% cheaper. Call me at 555-0123 before 9:30 pm!
Doctor Smith said: "Rest, drink water, and don't worry." She's right, isn't she? We'll see.
Why do people whisper in libraries? Because loud voices disturb everyone who is reading quietly.
Engineers measure latency, throughput, real-time factor and memory usage for every release.
The server accepts requests over gRPC, schedules them in batches and streams the results back.
Yesterday, my neighbour planted tomatoes, carrots, onions, potatoes, beans and strawberries.
Music, mathematics, history, geography, chemistry, physics, biology and literature are subjects.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June
July August September October November December spring summer autumn winter north south east west
zero one two three four five six seven eight nine ten eleven twelve twenty thirty hundred thousand
I think, therefore I am. To be, or not to be: that is the question. All's well that ends well.
Could you speak a little more slowly, please? Of course, I would be happy to help you with that.
The children laughed [laughter] and then took a deep breath [breath] before singing again.
"""

_CORPUS_ZH = """\
今天的天气很好，我们一起去公园散步吧。
在他讲述那个故事的时候，他突然停了下来。
用四川话说这句话。希望你以后能够做得比我还好哟。
收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。
八百标兵奔北坡，炮兵并排北边跑。吃葡萄不吐葡萄皮，不吃葡萄倒吐葡萄皮。
语音合成系统把文字转换成自然流畅的声音，流式输出可以降低首包延迟。
春天来了，花儿开了，小鸟在树上唱歌，孩子们在草地上奔跑。
请问去火车站怎么走？一直往前走，到第二个路口向右转就到了。
这件外套原价两百九十九元，现在打八折，只要两百三十九元。
中国的首都是北京，上海是一个国际化的大城市，广州和深圳在南方。
他每天早上七点起床，先喝一杯水，然后跑步半个小时。
学习一门新的语言需要耐心，多听多说多读多写，进步就会很快。
"""


def _training_corpus() -> list[str]:
    lines = [ln for ln in (_CORPUS_EN + _CORPUS_ZH).splitlines() if ln.strip()]
    return lines * 3


def train_bpe(vocab_size: int):
    """A Qwen2-style byte-level BPE (no specials) trained on the built-in corpus; deterministic."""
    from tokenizers import pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = qwen2_pipeline(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                             fuse_unk=False, byte_fallback=False))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    return tok


def write_blank_en(out: Path, preset: Preset) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(preset.bpe_vocab)
    n_bpe = tok.get_vocab_size(with_added_tokens=False)
    vocab = tok.get_vocab(with_added_tokens=False)
    assert sorted(vocab.values()) == list(range(n_bpe)), "BPE ids are not contiguous"
    q = preset.dims.lm.qwen
    if q.vocab_size < n_bpe + len(BASE_SPECIALS) + len(SPECIAL_TOKENS[preset.dims.kind]) - 1:
        raise ValueError(f"preset {preset.name}: config vocab_size {q.vocab_size} < tokenizer length")
    (out / "vocab.json").write_text(
        json.dumps(dict(sorted(vocab.items(), key=lambda kv: kv[1])), ensure_ascii=False, separators=(",", ":")),
        encoding="utf-8")
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    eos_id = n_bpe
    special = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    tokenizer_config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(n_bpe + i): {"content": t, **special} for i, t in enumerate(BASE_SPECIALS)},
        "additional_special_tokens": list(BASE_SPECIALS[1:]),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": q.max_position_embeddings,
        "pad_token": EOS_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "hidden_act": "silu",
        "initializer_range": STD,
        "max_window_layers": q.num_layers,
        "model_type": "qwen2",
        "sliding_window": q.max_position_embeddings,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        **qwen_config(q),
    }
    generation_config = {"bos_token_id": eos_id, "do_sample": False, "eos_token_id": eos_id, "max_new_tokens": 2048}
    for name, obj in (("tokenizer_config.json", tokenizer_config), ("config.json", config),
                      ("generation_config.json", generation_config)):
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n",
                                encoding="utf-8")
