// The demo page: POST /v1/audio/speech (pcm = 24 kHz s16le) read as a stream and played with
// Web Audio as the bytes arrive; voices from GET/POST /v1/audio/voices. No build step.
"use strict";

const SAMPLE_RATE = 24000;
const $ = (id) => document.getElementById(id);

let model = "tts-1";  // replaced by the served model's name (GET /v1/models)
let audioCtx = null;
let current = null;  // {abort: AbortController, sources: AudioBufferSourceNode[]}

function headers(extra = {}) {
  const token = $("token").value.trim();
  return token ? { ...extra, Authorization: `Bearer ${token}` } : extra;
}

function showError(message) {
  $("error").textContent = message || "";
}

async function apiError(response) {
  try {
    const body = await response.json();
    if (body && body.error) return `${response.status} ${body.error.code || ""}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

async function loadVoices(select) {
  const response = await fetch("/v1/audio/voices", { headers: headers() });
  if (!response.ok) { showError(await apiError(response)); return; }
  const voices = (await response.json()).data;
  const models = await fetch("/v1/models", { headers: headers() });
  if (models.ok) model = (await models.json()).data[0].id;
  const menu = $("voice");
  const keep = select || menu.value;
  showError("");
  menu.innerHTML = "";
  for (const v of voices) {
    const option = document.createElement("option");
    option.value = v.id;
    option.textContent = `${v.id} (${v.kind}${v.aliases.length ? ", " + v.aliases.join(", ") : ""})`;
    menu.appendChild(option);
  }
  if (voices.some((v) => v.id === keep)) menu.value = keep;
  if (!voices.length) showError("No voices registered yet: upload a recording below.");
}

function setStat(id, text) { $(id).textContent = text; }

function resetStats() {
  for (const id of ["latency", "audio-seconds", "rtf", "received"]) setStat(id, "–");
}

// PCM s16le bytes -> Float32 samples; an odd trailing byte is kept for the next read.
function pcmToFloat(bytes) {
  const n = bytes.length >> 1;
  const view = new DataView(bytes.buffer, bytes.byteOffset, n * 2);
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) out[i] = view.getInt16(2 * i, true) / 32768;
  return out;
}

async function speak() {
  stop();
  showError("");
  resetStats();
  const text = $("text").value;
  const voice = $("voice").value;
  if (!voice) { showError("Pick a voice (or register one below)."); return; }
  if (!audioCtx) audioCtx = new AudioContext({ sampleRate: SAMPLE_RATE });
  await audioCtx.resume();

  const abort = new AbortController();
  const run = { abort, sources: [] };
  current = run;
  $("speak").disabled = true;
  $("stop").disabled = false;
  $("status").textContent = "Synthesizing…";
  const started = performance.now();
  let playAt = 0, samples = 0, chunks = 0, bytes = 0, carry = new Uint8Array(0);
  const body = { model, input: text, voice, response_format: "pcm" };
  const instructions = $("instructions").value.trim();
  if (instructions) body.instructions = instructions;
  try {
    const response = await fetch("/v1/audio/speech", {
      method: "POST", signal: abort.signal,
      headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body),
    });
    if (!response.ok) throw new Error(await apiError(response));
    const reader = response.body.getReader();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      chunks += 1;
      bytes += value.length;
      const joined = new Uint8Array(carry.length + value.length);
      joined.set(carry); joined.set(value, carry.length);
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
      const source = audioCtx.createBufferSource();
      source.buffer = buffer;
      source.connect(audioCtx.destination);
      playAt = Math.max(playAt, audioCtx.currentTime);
      source.start(playAt);
      playAt += buffer.duration;
      run.sources.push(source);
      samples += pcm.length;
      setStat("audio-seconds", `${(samples / SAMPLE_RATE).toFixed(2)} s`);
      setStat("received", `${chunks} / ${bytes}`);
    }
    const seconds = samples / SAMPLE_RATE;
    const wall = (performance.now() - started) / 1000;
    setStat("rtf", seconds > 0 ? (wall / seconds).toFixed(3) : "–");
    $("status").textContent = seconds > 0 ? `Done: ${seconds.toFixed(2)} s of audio in ${wall.toFixed(2)} s.`
                                          : "Done, but no audio came back.";
  } catch (e) {
    if (e.name !== "AbortError") showError(e.message || String(e));
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
  showError("");
  const id = $("new-id").value.trim();
  const file = $("new-audio").files[0];
  const transcript = $("new-transcript").value;
  if (!id || !file || !transcript.trim()) { showError("A voice needs an id, a recording and its transcript."); return; }
  const form = new FormData();
  form.append("id", id);
  form.append("transcript", transcript);
  form.append("audio", file);
  $("status").textContent = "Registering…";
  const response = await fetch("/v1/audio/voices", { method: "POST", headers: headers(), body: form });
  if (!response.ok) { showError(await apiError(response)); $("status").textContent = "Failed."; return; }
  await loadVoices(id);
  $("status").textContent = `Registered ${id}.`;
}

$("speak").addEventListener("click", speak);
$("stop").addEventListener("click", stop);
$("register").addEventListener("click", register);
$("token").addEventListener("change", () => loadVoices());
loadVoices();
