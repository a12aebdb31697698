"""Speech's pure parts (issue 41): the sentence splitter both sides stream by, a voice's speakers
and OpenAI's voice names, and the WAV header a streamed answer starts with."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile

from worker.media_encoding.audio import encode, encode_piece, resample, wav_header
from worker.protocol.errors import APIError
from worker.protocol.speech import OPENAI_VOICES, read_voice, sentences, split_sentences


@pytest.mark.parametrize(("text", "done", "rest"), [
    ("Hello there. How are", ["Hello there. "], "How are"),
    ("It is 3.5 degrees. Cold", ["It is 3.5 degrees. "], "Cold"),  # a decimal point ends nothing
    ("See e.g. this. Next", ["See e.g. this. "], "Next"),  # nor does an abbreviation
    ("Dr. Who came! Did he? Yes", ["Dr. Who came! ", "Did he? "], "Yes"),
    ('He said "stop." Then', ['He said "stop." '], "Then"),  # closing quotes stay with their sentence
    ("Wait...", [], "Wait..."),  # at the very end: the next piece may continue it
    ("Line one\nLine two", ["Line one\n"], "Line two"),
    ("你好。世界", ["你好。"], "世界"),
    ("", [], ""),
])
def test_split_sentences_keeps_every_character(text: str, done: list[str], rest: str) -> None:
    got_done, got_rest = split_sentences(text)
    assert (got_done, got_rest) == (done, rest)
    assert "".join(got_done) + got_rest == text


def test_sentences_flushes_the_rest_and_drops_blank_ones() -> None:
    assert sentences("One. Two.\n\n  ") == ["One. ", "Two.\n\n  "]  # spacing stays with its sentence
    assert sentences("  ") == []


def _voice(tmp_path: Path, config: dict[str, object]) -> Path:
    model = tmp_path / "v.onnx"
    model.write_bytes(b"")
    Path(f"{model}.json").write_text(json.dumps(config))
    return model


def test_a_single_speaker_voice_takes_its_name_and_every_openai_name(tmp_path: Path) -> None:
    info = read_voice(_voice(tmp_path, {"audio": {"sample_rate": 22050}, "num_speakers": 1}))
    assert (info.sample_rate, info.speakers) == (22050, ("v",))
    assert {info.speaker_id(v) for v in ("v", *OPENAI_VOICES)} == {0}
    with pytest.raises(APIError) as e:
        info.speaker_id("nobody", param="audio.voice")
    assert e.value.param == "audio.voice" and "alloy" in e.value.message


def test_openai_names_take_a_multi_speaker_voices_speakers_in_turn(tmp_path: Path) -> None:
    info = read_voice(_voice(tmp_path, {"audio": {"sample_rate": 16000}, "num_speakers": 3,
                                        "speaker_id_map": {"b": 1, "a": 0, "c": 2}}))
    assert info.speakers == ("a", "b", "c") and info.speaker_id("c") == 2
    assert [info.speaker_id(v) for v in OPENAI_VOICES[:4]] == [0, 1, 2, 0]


def test_a_config_that_is_not_a_voice_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a Piper voice config"):
        read_voice(_voice(tmp_path, {"audio": {}}))


def test_a_streamed_wav_is_a_header_saying_until_the_end_then_samples() -> None:
    samples = (np.sin(np.arange(1600) / 5) * 8000).astype(np.int16)
    stream = encode_piece(samples, 16000, "wav", True) + encode_piece(samples, 16000, "wav", False)
    assert stream[:4] == b"RIFF" and stream[40:44] == b"\xff\xff\xff\xff" and len(stream) == 44 + 2 * 3200
    whole = encode(np.concatenate([samples, samples]), 16000, "wav")
    assert whole[44:] == stream[44:] and whole[:44] == wav_header(16000, 6400)
    decoded, rate = soundfile.read(io.BytesIO(whole), dtype="int16")
    assert rate == 16000 and np.array_equal(decoded, np.concatenate([samples, samples]))


def test_resample_keeps_the_duration() -> None:
    samples = np.arange(22050, dtype=np.int16)
    assert resample(samples, 22050, 24000).size == 24000
    assert resample(samples, 16000, 16000) is samples
