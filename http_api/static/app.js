// The demo page: POST /v1/audio/speech read as a stream and played with Web Audio (pcm and wav
// as the bytes arrive, compressed formats once complete); voices from GET/POST /v1/audio/voices,
// formats from GET /v1/audio/formats. No build step.
"use strict";

const SAMPLE_RATE = 24000;  // OpenAI's speech rate: every response_format comes at 24 kHz
const WAV_HEADER_BYTES = 44;  // the server's streaming WAV header
const EXTENSIONS = { pcm: "wav", wav: "wav", mp3: "mp3", opus: "opus", aac: "aac", flac: "flac" };
const $ = (id) => document.getElementById(id);

let model = "tts-1";  // replaced by the served model's name (GET /v1/models)
let audioCtx = null;
let analyser = null;  // every source plays through it; the canvas draws what it hears
let current = null;  // {abort: AbortController, sources: AudioBufferSourceNode[]}
let downloadUrl = null;

function headers(extra = {}) {
  const token = $("token").value.trim();
  return token ? { ...extra, Authorization: `Bearer ${token}` } : extra;
}

// Each form shows its own errors: "error" (Speak), "register-error", "server-error".
function showError(where, message) {
  $(where).textContent = message || "";
}

async function apiError(response) {
  try {
    const body = await response.json();
    if (body && body.error) {
      let message = `${response.status} ${body.error.code || ""}: ${body.error.message}`;
      if (body.error.code === "voice_exists") message += " (tick “Overwrite” to replace it)";
      return message;
    }
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

async function getJson(path) {
  const response = await fetch(path, { headers: headers() });
  if (!response.ok) throw new Error(await apiError(response));
  return response.json();
}

async function loadServer(select) {
  let voices, formats;
  try {
    [voices, formats] = await Promise.all([getJson("/v1/audio/voices"), getJson("/v1/audio/formats")]);
    model = (await getJson("/v1/models")).data[0].id;
  } catch (e) {
    showError("server-error", e.message);
    return;
  }
  showError("server-error", "");
  fillVoices(voices.data, select);
  fillFormats(formats.data.filter((f) => f.speech));
}

function fillVoices(voices, select) {
  const menu = $("voice");
  const keep = select || menu.value;
  menu.innerHTML = "";
  for (const v of voices) {
    const option = document.createElement("option");
    option.value = v.id;
    option.textContent = `${v.id} (${v.kind}${v.aliases.length ? ", " + v.aliases.join(", ") : ""})`;
    menu.appendChild(option);
  }
  if (voices.some((v) => v.id === keep)) menu.value = keep;
  showError("error", voices.length ? "" : "No voices registered yet: upload a recording below.");
}

function fillFormats(formats) {
  const menu = $("format");
  const keep = menu.value || "pcm";
  menu.innerHTML = "";
  for (const f of formats) {
    const option = document.createElement("option");
    option.value = f.id;
    option.textContent = `${f.id} (${f.content_type})`;
    menu.appendChild(option);
  }
  if (formats.some((f) => f.id === keep)) menu.value = keep;
}

function setStat(id, text) { $(id).textContent = text; }

function resetStats() {
  for (const id of ["latency", "audio-seconds", "rtf", "received"]) setStat(id, "–");
}

// PCM s16le bytes -> Float32 samples (an even number of bytes).
function pcmToFloat(bytes) {
  const n = bytes.length >> 1;
  const view = new DataView(bytes.buffer, bytes.byteOffset, n * 2);
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) out[i] = view.getInt16(2 * i, true) / 32768;
  return out;
}

function wavHeader(dataBytes) {
  const view = new DataView(new ArrayBuffer(WAV_HEADER_BYTES));
  const ascii = (at, s) => { for (let i = 0; i < s.length; i++) view.setUint8(at + i, s.charCodeAt(i)); };
  ascii(0, "RIFF"); view.setUint32(4, 36 + dataBytes, true); ascii(8, "WAVE");
  ascii(12, "fmt "); view.setUint32(16, 16, true); view.setUint16(20, 1, true); view.setUint16(22, 1, true);
  view.setUint32(24, SAMPLE_RATE, true); view.setUint32(28, 2 * SAMPLE_RATE, true);
  view.setUint16(32, 2, true); view.setUint16(34, 16, true);
  ascii(36, "data"); view.setUint32(40, dataBytes, true);
  return new Uint8Array(view.buffer);
}

function concat(parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) { out.set(p, at); at += p.length; }
  return out;
}

// What was spoken, as a file: pcm becomes a WAV (with exact sizes), the rest is kept as sent.
function offerDownload(format, parts, contentType) {
  let blob;
  if (format === "pcm" || format === "wav") {
    const pcm = concat(format === "wav" ? [concat(parts).subarray(WAV_HEADER_BYTES)] : parts);
    blob = new Blob([wavHeader(pcm.length & ~1), pcm.subarray(0, pcm.length & ~1)], { type: "audio/wav" });
  } else {
    blob = new Blob(parts, { type: contentType });
  }
  downloadUrl = URL.createObjectURL(blob);
  const link = $("download");
  link.href = downloadUrl;
  link.download = `speech.${EXTENSIONS[format] || format}`;
  link.textContent = `Download ${link.download}`;
  link.hidden = false;
}

function clearDownload() {
  if (downloadUrl) URL.revokeObjectURL(downloadUrl);
  downloadUrl = null;
  $("download").hidden = true;
}

// ---- the level view: the waveform the analyser hears, drawn while anything plays ----

const meter = { playingUntil: 0, frames: 0, peak: 0, running: false };

function startMeter(until) {
  meter.playingUntil = Math.max(meter.playingUntil, until);
  if (!meter.running) { meter.running = true; requestAnimationFrame(drawWave); }
}

function drawWave() {
  const canvas = $("wave");
  const g = canvas.getContext("2d");
  const samples = new Float32Array(analyser.fftSize);
  analyser.getFloatTimeDomainData(samples);
  let peak = 0;
  for (const s of samples) peak = Math.max(peak, Math.abs(s));
  g.clearRect(0, 0, canvas.width, canvas.height);
  g.fillStyle = "#1d4ed8";
  g.fillRect(0, canvas.height - 4, canvas.width * Math.min(1, peak), 4);  // the level bar
  g.strokeStyle = "#1d4ed8";
  g.beginPath();
  for (let x = 0; x < canvas.width; x++) {
    const s = samples[Math.floor(x * samples.length / canvas.width)];
    const y = (0.5 - 0.45 * Math.max(-1, Math.min(1, s))) * (canvas.height - 4);
    if (x === 0) g.moveTo(x, y); else g.lineTo(x, y);
  }
  g.stroke();
  meter.frames += 1;
  meter.peak = Math.max(meter.peak, peak);
  canvas.dataset.frames = String(meter.frames);
  canvas.dataset.peak = meter.peak.toFixed(4);
  if (audioCtx.currentTime < meter.playingUntil + 0.1) requestAnimationFrame(drawWave);
  else meter.running = false;
}

function ensureAudio() {
  if (!audioCtx) {
    audioCtx = new AudioContext({ sampleRate: SAMPLE_RATE });
    analyser = audioCtx.createAnalyser();
    analyser.fftSize = 2048;
    analyser.connect(audioCtx.destination);
  }
  return audioCtx.resume();
}

// Schedules `buffer` after what is queued; returns when it ends (audio-clock seconds).
function play(run, buffer, at) {
  const source = audioCtx.createBufferSource();
  source.buffer = buffer;
  source.connect(analyser);
  const start = Math.max(at, audioCtx.currentTime);
  source.start(start);
  run.sources.push(source);
  startMeter(start + buffer.duration);
  return start + buffer.duration;
}

async function speak() {
  stop();
  showError("error", "");
  resetStats();
  clearDownload();
  const text = $("text").value;
  const voice = $("voice").value;
  const format = $("format").value || "pcm";
  if (!voice) { showError("error", "Pick a voice (or register one below)."); return; }
  await ensureAudio();

  const abort = new AbortController();
  const run = { abort, sources: [] };
  current = run;
  $("speak").disabled = true;
  $("stop").disabled = false;
  $("status").textContent = "Synthesizing…";
  const started = performance.now();
  const streamed = format === "pcm" || format === "wav";
  let playAt = 0, samples = 0, chunks = 0, bytes = 0, skip = format === "wav" ? WAV_HEADER_BYTES : 0;
  let carry = new Uint8Array(0);
  const parts = [];
  const body = { model, input: text, voice, response_format: format };
  const instructions = $("instructions").value.trim();
  if (instructions) body.instructions = instructions;
  try {
    const response = await fetch("/v1/audio/speech", {
      method: "POST", signal: abort.signal,
      headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body),
    });
    if (!response.ok) throw new Error(await apiError(response));
    const contentType = response.headers.get("content-type");
    const reader = response.body.getReader();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      chunks += 1;
      bytes += value.length;
      parts.push(value);
      setStat("received", `${chunks} / ${bytes}`);
      if (samples === 0 && !streamed) setStat("latency", `${Math.round(performance.now() - started)} ms`);
      if (!streamed) continue;
      let joined = concat([carry, value]);
      const cut = Math.min(skip, joined.length);
      skip -= cut;
      joined = joined.subarray(cut);
      const even = joined.length & ~1;
      carry = joined.slice(even);
      const pcm = pcmToFloat(joined.subarray(0, even));
      if (!pcm.length) continue;
      if (samples === 0) {
        setStat("latency", `${Math.round(performance.now() - started)} ms`);
        playAt = audioCtx.currentTime + 0.05;
      }
      const buffer = audioCtx.createBuffer(1, pcm.length, SAMPLE_RATE);
      buffer.copyToChannel(pcm, 0);
      playAt = play(run, buffer, playAt);
      samples += pcm.length;
      setStat("audio-seconds", `${(samples / SAMPLE_RATE).toFixed(2)} s`);
    }
    if (!streamed && bytes > 0) {
      const whole = concat(parts);
      const buffer = await audioCtx.decodeAudioData(whole.buffer.slice(whole.byteOffset, whole.byteOffset + whole.length));
      samples = Math.round(buffer.duration * SAMPLE_RATE);
      setStat("audio-seconds", `${buffer.duration.toFixed(2)} s`);
      play(run, buffer, audioCtx.currentTime + 0.05);
    }
    const seconds = samples / SAMPLE_RATE;
    const wall = (performance.now() - started) / 1000;
    setStat("rtf", seconds > 0 ? (wall / seconds).toFixed(3) : "–");
    if (bytes > 0) offerDownload(format, parts, contentType);
    $("status").textContent = seconds > 0 ? `Done: ${seconds.toFixed(2)} s of audio in ${wall.toFixed(2)} s.`
                                          : "Done, but no audio came back.";
  } catch (e) {
    if (e.name !== "AbortError") showError("error", e.message || String(e));
    $("status").textContent = e.name === "AbortError" ? "Stopped." : "Failed.";
  } finally {
    if (current === run) { $("speak").disabled = false; $("stop").disabled = true; }
  }
}

function stop() {
  if (!current) return;
  current.abort.abort();  // closes the connection: the server cancels the synthesis
  for (const s of current.sources) { try { s.stop(); } catch (_) { /* not started */ } }
  current = null;
  $("speak").disabled = false;
  $("stop").disabled = true;
}

async function register() {
  showError("register-error", "");
  $("register-status").textContent = "";
  const id = $("new-id").value.trim();
  const file = $("new-audio").files[0];
  const transcript = $("new-transcript").value;
  if (!id || !file || !transcript.trim()) {
    showError("register-error", "A voice needs an id, a recording and its transcript.");
    return;
  }
  const form = new FormData();
  form.append("id", id);
  form.append("transcript", transcript);
  form.append("audio", file);
  if ($("new-overwrite").checked) form.append("overwrite", "true");
  $("register-status").textContent = "Registering…";
  const response = await fetch("/v1/audio/voices", { method: "POST", headers: headers(), body: form });
  if (!response.ok) {
    showError("register-error", await apiError(response));
    $("register-status").textContent = "Failed.";
    return;
  }
  await loadServer(id);
  $("register-status").textContent = `Registered ${id}.`;
}

$("speak").addEventListener("click", speak);
$("stop").addEventListener("click", stop);
$("register").addEventListener("click", register);
$("token").addEventListener("change", () => loadServer());
loadServer();
