"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` (OpenAI's shape, vLLM's
streaming) for an encoder-decoder speech model (Whisper).

An upload is decoded off the event loop (mono, resampled), cut into 30 s
windows at quiet points (as vLLM), turned into log-mel features on the shared
:class:`FeaturePool` (batched with other requests' windows), and each window
runs as one engine request whose decoder prompt forces
``[<|startofprev|> prompt] <|startoftranscript|> <|lang|> <|task|> [<|notimestamps|>]``.
The windows' texts are joined in order.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from inference_engine.entrypoints.openai.errors import APIError, JSONResponse
from inference_engine.entrypoints.openai.serving import (
    ChoiceCursor,
    EngineRequest,
    ModelServing,
)
from inference_engine.entrypoints.openai.speech_format import (
    Segment,
    parse_segments,
    to_srt,
    to_vtt,
)
from inference_engine.entrypoints.openai.speech_scores import WindowScores, window_scores
from inference_engine.entrypoints.openai.streaming import (
    DONE,
    EngineStreamingResponse,
    sse,
    sse_error,
)
from inference_engine.outputs import RequestOutput
from inference_engine.sampling_params import SamplingParams

__all__ = ["SpeechServing", "add_speech_routes"]

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
# Form fields each endpoint takes; anything else is a 400 naming it.
_FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature",
           "timestamp_granularities[]", "timestamp_granularities", "stream",
           "stream_include_usage", "seed", "top_p", "top_k", "max_completion_tokens"}


@dataclass
class _Form:
    """The parsed multipart fields of one request."""

    audio: bytes
    model: str | None
    language: str | None
    prompt: str
    response_format: str
    temperature: float
    timestamps: bool
    stream: bool
    include_usage: bool
    seed: int | None
    top_p: float | None
    top_k: int | None
    max_tokens: int | None


class SpeechServing:
    """The speech model's facts the endpoints need: features, pool, special tokens."""

    def __init__(self, serving: ModelServing, max_file_bytes: int, max_seconds: float) -> None:
        from inference_engine.audio.feature_pool import FeaturePool
        from inference_engine.audio.whisper_features import WhisperFeatureConfig, WhisperFeatures
        from inference_engine.engine.hub import resolve_model_path
        from inference_engine.interfaces.encoder_decoder import EncoderDecoderLM

        self.serving = serving
        self.max_file_bytes = max_file_bytes
        self.max_seconds = max_seconds
        inner = serving.engine.engine
        self.is_supported = isinstance(inner.model, EncoderDecoderLM)
        self.pool: FeaturePool | None = None
        if not self.is_supported:
            return
        path = resolve_model_path(inner.config.model.model)
        self.features = WhisperFeatures(WhisperFeatureConfig.from_pretrained(path))
        self.pool = FeaturePool(self.features)
        tok = serving.tokenizer
        vocab = tok.get_vocab()
        self.eos_ids = set(inner.eos_token_ids)

        def special(name: str) -> int:
            if name not in vocab:
                raise ValueError(f"the tokenizer of {path} has no {name} token (not a Whisper "
                                 f"tokenizer)")
            return vocab[name]

        self.start_of_transcript = special("<|startoftranscript|>")
        self.task_ids = {"transcribe": special("<|transcribe|>"),
                         "translate": special("<|translate|>")}
        self.no_timestamps = special("<|notimestamps|>")
        self.timestamp_begin = special("<|0.00|>")
        self.start_of_prev = vocab.get("<|startofprev|>")
        from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

        self.language_names = LANGUAGES
        self.language_codes = TO_LANGUAGE_CODE
        self.language_ids = {code: vocab[f"<|{code}|>"] for code in LANGUAGES
                             if f"<|{code}|>" in vocab}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    # ---- the request ----------------------------------------------------------------
    async def parse_form(self, request: Request) -> _Form:
        """The multipart form; 400s name the field (wrong type, missing, bad value)."""
        content_type = request.headers.get("content-type", "")
        if not content_type.startswith("multipart/form-data"):
            raise APIError(f"this endpoint takes multipart/form-data with an audio file; got "
                           f"{content_type or 'no content type'!r}", param="file")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_file_bytes + (1 << 20):
            raise APIError(self._too_large(int(length)), param="file")
        try:
            form = await request.form(max_files=1, max_fields=64)
        except Exception as exc:  # noqa: BLE001 - python-multipart's parse errors vary
            raise APIError(f"the multipart body cannot be parsed: {exc}", param="file") from None
        try:
            return await self._read_form(form)
        finally:
            await form.close()

    def _too_large(self, size: int) -> str:
        return (f"the upload has {size} bytes; this server takes audio files up to "
                f"{self.max_file_bytes} bytes (--max-audio-file-size-mb)")

    async def _read_form(self, form: Any) -> _Form:
        unknown = sorted(set(form.keys()) - _FIELDS)
        if unknown:
            raise APIError(f"unsupported field {unknown[0]!r} (this server takes: "
                           f"{', '.join(sorted(_FIELDS))})", param=unknown[0])
        upload = form.get("file")
        if upload is None:
            raise APIError("the form has no 'file' field (the audio to transcribe)", param="file")
        if not isinstance(upload, UploadFile):
            raise APIError("'file' must be an uploaded file, not a text field", param="file")
        data = await upload.read(self.max_file_bytes + 1)
        if len(data) > self.max_file_bytes:
            raise APIError(self._too_large(len(data)), param="file")

        def text(name: str) -> str | None:
            value = form.get(name)
            if value is not None and not isinstance(value, str):
                raise APIError(f"{name!r} must be a text field", param=name)
            return value

        def number(name: str, kind: type, low: float, high: float) -> Any:
            raw = text(name)
            if raw is None or raw == "":
                return None
            try:
                value = kind(raw)
            except ValueError:
                raise APIError(f"{name} must be a {kind.__name__}, got {raw!r}",
                               param=name) from None
            if not low <= value <= high or (kind is float and not math.isfinite(value)):
                raise APIError(f"{name} must be in [{low}, {high}], got {raw}", param=name)
            return value

        def flag(name: str) -> bool:
            raw = (text(name) or "false").strip().lower()
            if raw not in ("true", "false", "1", "0"):
                raise APIError(f"{name} must be true or false, got {raw!r}", param=name)
            return raw in ("true", "1")

        response_format = text("response_format") or "json"
        if response_format not in RESPONSE_FORMATS:
            raise APIError(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}; got "
                           f"{response_format!r}", param="response_format")
        granularities = [g for key in ("timestamp_granularities[]", "timestamp_granularities")
                         for g in form.getlist(key)]
        for g in granularities:
            if g == "word":
                raise APIError("timestamp_granularities 'word' is not implemented (only "
                               "'segment')", param="timestamp_granularities")
            if g != "segment":
                raise APIError(f"timestamp_granularities must be 'segment' or 'word', got {g!r}",
                               param="timestamp_granularities")
        if granularities and response_format != "verbose_json":
            raise APIError("timestamp_granularities needs response_format verbose_json",
                           param="timestamp_granularities")
        stream = flag("stream")
        if stream and response_format not in ("json", "text"):
            raise APIError(f"stream=true returns text deltas; response_format "
                           f"{response_format!r} cannot stream", param="stream")
        temperature = number("temperature", float, 0.0, 2.0)
        return _Form(
            audio=data, model=text("model"), language=text("language") or None,
            prompt=(text("prompt") or "").strip(), response_format=response_format,
            temperature=0.0 if temperature is None else temperature,
            timestamps=response_format in ("verbose_json", "srt", "vtt"), stream=stream,
            include_usage=flag("stream_include_usage"), seed=number("seed", int, 0, 2**63 - 1),
            top_p=number("top_p", float, 0.0, 1.0), top_k=number("top_k", int, -1, 1 << 30),
            max_tokens=number("max_completion_tokens", int, 1, 1 << 30))

    def language_code(self, language: str | None) -> str:
        """The request's language as a code with a token (default ``en``, as vLLM)."""
        if language is None:
            return "en" if "en" in self.language_ids else next(iter(self.language_ids))
        code = language.strip().lower()
        code = self.language_codes.get(code, code)
        if code not in self.language_ids:
            raise APIError(f"language {language!r} is not one this model knows (codes: "
                           f"{', '.join(sorted(self.language_ids))})", param="language")
        return code

    async def decoder_prompt(self, form: _Form, task: str, language: str) -> list[int]:
        ids: list[int] = []
        if form.prompt:
            if self.start_of_prev is None:
                raise APIError("this model's tokenizer has no <|startofprev|>: prompt is not "
                               "supported", param="prompt")
            ids = [self.start_of_prev] + await self.serving.encode(
                " " + form.prompt, add_special_tokens=False, param="prompt")
        ids += [self.start_of_transcript, self.language_ids[language], self.task_ids[task]]
        if not form.timestamps:
            ids.append(self.no_timestamps)
        return ids


async def _transcribe(speech: SpeechServing, raw: Request, task: str) -> Response:
    from inference_engine.audio.decode import AudioError, decode_audio
    from inference_engine.audio.whisper_features import split_windows

    serving = speech.serving
    if not speech.is_supported:
        raise APIError(f"the served model ({serving.architecture}) is not a speech model; "
                       f"/v1/audio/{task}s needs one (Whisper)", status=400)
    form = await speech.parse_form(raw)
    lora = serving.check_model(form.model)
    if lora is not None:
        raise APIError("LoRA adapters are not supported for speech models", param="model")
    language = speech.language_code(form.language)
    prompt_ids = await speech.decoder_prompt(form, task, language)
    serving.check_prompt(prompt_ids)
    rate = speech.features.config.sampling_rate
    assert speech.pool is not None
    try:
        audio = await speech.pool.run(decode_audio, form.audio, rate, speech.max_seconds)
    except AudioError as exc:
        raise APIError(str(exc), param="file") from None
    windows = split_windows(audio.samples, rate, speech.features.config.chunk_length)
    features = await speech.pool.extract([clip for _, clip in windows])
    request_id = serving.new_request_id("trsc" if task == "transcribe" else "trsl", None)
    room = serving.max_model_len - len(prompt_ids)
    max_tokens = room if form.max_tokens is None else form.max_tokens
    if max_tokens > room:
        raise APIError(f"max_completion_tokens {max_tokens} does not fit: the decoder holds "
                       f"{serving.max_model_len} tokens and the prompt takes {len(prompt_ids)}",
                       param="max_completion_tokens")
    try:
        params = SamplingParams(temperature=form.temperature, seed=form.seed,
                                top_p=1.0 if form.top_p is None else form.top_p,
                                top_k=-1 if form.top_k is None else form.top_k,
                                max_tokens=max_tokens, skip_special_tokens=True,
                                # verbose_json's avg_logprob: each sampled token's logprob.
                                logprobs=0 if form.response_format == "verbose_json" else None)
    except ValueError as exc:
        raise APIError(str(exc)) from None
    requests = [EngineRequest(f"{request_id}-{i}", None, list(prompt_ids), params)
                for i in range(len(windows))]
    streams = await _start(serving, requests, list(features))
    run = _Transcription(speech, form, task, language, request_id, requests, windows,
                         audio.duration)
    if form.stream:
        return EngineStreamingResponse(run.events(streams), run.release,
                                       headers={"X-Request-Id": request_id})
    try:
        finals = await run.collect(streams)
    finally:
        await run.release()
    return run.response(finals)


async def _start(serving: ModelServing, requests: list[EngineRequest],
                 features: list[Any]) -> list[AsyncIterator[RequestOutput]]:
    """Queue each window's engine request with its features; on a refusal abort the ones
    already queued (400 for what the engine refuses, 503 when it is not running)."""
    from inference_engine.engine.async_client import EngineDeadError

    streams: list[AsyncIterator[RequestOutput]] = []
    try:
        for r, feats in zip(requests, features, strict=True):
            streams.append(await serving.engine.add_request(
                {"prompt_token_ids": r.prompt_token_ids, "encoder_inputs": feats}, r.params,
                request_id=r.engine_id))
    except BaseException as exc:
        if streams:
            with contextlib.suppress(Exception):
                await serving.engine.abort([r.engine_id for r in requests[: len(streams)]])
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
        if isinstance(exc, EngineDeadError):
            raise APIError(str(exc), status=503) from None
        if isinstance(exc, ValueError):
            raise APIError(str(exc)) from None
        raise
    return streams


class _Transcription:
    """One transcription in flight: its windows' engine requests, in order."""

    def __init__(self, speech: SpeechServing, form: _Form, task: str, language: str,
                 request_id: str, requests: list[EngineRequest],
                 windows: list[tuple[int, Any]], duration: float) -> None:
        self.speech = speech
        self.form = form
        self.task = task
        self.language = language
        self.request_id = request_id
        self.requests = requests
        self.windows = windows
        self.duration = duration
        self.finished: set[int] = set()
        self.created = int(time.time())

    async def release(self) -> None:
        unfinished = [r.engine_id for i, r in enumerate(self.requests) if i not in self.finished]
        if unfinished:
            with contextlib.suppress(Exception):
                await self.speech.serving.engine.abort(unfinished)

    def _note(self, index: int, output: RequestOutput) -> None:
        if output.finished:
            self.finished.add(index)
            if output.error:
                raise APIError(output.error, status=500)

    async def collect(self, streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        finals = []
        for index, stream in enumerate(streams):
            last = None
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for output in stream:
                    self._note(index, output)
                    last = output
            assert last is not None
            finals.append(last)
        return finals

    def _usage(self) -> dict[str, Any]:
        return {"type": "duration", "seconds": int(math.ceil(self.duration))}

    def _segments(self, finals: list[RequestOutput],
                  scored: bool = False) -> list[tuple[Segment, WindowScores | None]]:
        """Every window's segments in order, each with its window's scores (``scored``:
        from the sampled tokens' logprobs, which the request then asked for)."""
        rate = self.speech.features.config.sampling_rate
        hop = self.speech.features.config.hop_length
        tokenizer = self.speech.serving.tokenizer

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        segments: list[tuple[Segment, WindowScores | None]] = []
        for (start, clip), output in zip(self.windows, finals, strict=True):
            completion = output.outputs[0]
            scores = None
            if scored:
                scores = window_scores(
                    completion.token_ids,
                    [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs,
                                                    strict=True)],
                    self.speech.eos_ids, self.speech.timestamp_begin, decode)
            segments += [(segment, scores) for segment in parse_segments(
                completion.token_ids, self.speech.timestamp_begin, self.speech.eos_ids,
                start / rate, (start + len(clip)) / rate, start // hop, decode)]
        return segments

    def response(self, finals: list[RequestOutput]) -> Response:
        text = "".join(o.outputs[0].text for o in finals).strip()
        fmt = self.form.response_format
        headers = {"X-Request-Id": self.request_id}
        if fmt == "text":
            return PlainTextResponse(text, headers=headers)
        if fmt == "json":
            return JSONResponse({"text": text, "usage": self._usage()}, headers=headers)
        scored = fmt == "verbose_json"
        pairs = self._segments(finals, scored)
        segments = [segment for segment, _ in pairs]
        if fmt == "srt":
            return PlainTextResponse(to_srt(segments), headers=headers)
        if fmt == "vtt":
            return PlainTextResponse(to_vtt(segments), headers=headers,
                                     media_type="text/vtt")
        return JSONResponse({
            "task": self.task,
            "language": self.speech.language_names[self.language],
            "duration": self.duration,
            "text": " ".join(s.text.strip() for s in segments) if segments else text,
            "segments": [{"id": i, "seek": s.seek, "start": s.start, "end": s.end,
                          "text": s.text, "tokens": s.tokens,
                          "temperature": self.form.temperature,
                          "avg_logprob": scores.avg_logprob,
                          "compression_ratio": scores.compression_ratio}
                         for i, (s, scores) in enumerate(pairs) if scores is not None],
            "usage": self._usage(),
        }, headers=headers)

    def _chunk(self, content: str | None, finish_reason: str | None = None,
               stop_reason: Any = None) -> dict[str, Any]:
        return {"id": self.request_id, "object": "transcription.chunk",
                "created": self.created,
                "model": self.speech.serving.response_model(self.form.model),
                "choices": [{"delta": {"content": content} if content is not None else {},
                             "finish_reason": finish_reason, "stop_reason": stop_reason}]}

    async def events(self, streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[bytes]:
        """vLLM's stream: ``transcription.chunk`` text deltas window after window, the last
        chunk with the finish reason, a usage chunk if asked, then ``[DONE]``."""
        prompt_tokens = completion_tokens = 0
        try:
            for index, stream in enumerate(streams):
                cursor = ChoiceCursor()
                async with contextlib.aclosing(stream):  # type: ignore[type-var]
                    async for output in stream:
                        self._note(index, output)
                        completion = output.outputs[0]
                        delta = cursor.advance(completion)
                        last = index == len(streams) - 1 and output.finished
                        if delta is not None and delta.text:
                            yield sse(self._chunk(delta.text))
                        if last:
                            yield sse(self._chunk(None, completion.finish_reason,
                                                  completion.stop_reason))
                        if output.finished:
                            prompt_tokens += len(output.prompt_token_ids)
                            completion_tokens += len(completion.token_ids)
            if self.form.include_usage:
                chunk = self._chunk(None)
                chunk["choices"] = []
                chunk["usage"] = {"prompt_tokens": prompt_tokens,
                                  "completion_tokens": completion_tokens,
                                  "total_tokens": prompt_tokens + completion_tokens}
                yield sse(chunk)
        except Exception as exc:  # noqa: BLE001 - sent as the stream's error event
            yield sse_error(exc)
        yield DONE


def add_speech_routes(app: Any, serving: ModelServing, max_file_bytes: int,
                      max_seconds: float) -> SpeechServing:
    """Register the two audio endpoints on ``app``; returns their shared state."""
    speech = SpeechServing(serving, max_file_bytes, max_seconds)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        return await _transcribe(speech, request, "transcribe")

    @app.post("/v1/audio/translations")
    async def translations(request: Request) -> Response:
        return await _transcribe(speech, request, "translate")

    return speech
