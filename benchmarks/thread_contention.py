"""GPU token2wav first chunk: main thread vs executor thread vs under asyncio vs beside a busy CUDA thread."""
import asyncio, time, threading, torch
from concurrent.futures import ThreadPoolExecutor
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.hift import NSFNoise
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream
md = load_model_dir('/tmp/m05'); m = build_models(md, device='cuda', dtype=torch.float16)
runner = Token2WavRunner(m.flow, m.hift)
g = torch.Generator().manual_seed(0)
pt = torch.randint(0, 6561, (1, 150), generator=g, dtype=torch.int32); pf = torch.randn(1, 300, 80, generator=g); emb = torch.randn(1, 192, generator=g)
toks = torch.randint(0, 6561, (120,), generator=g).tolist()
def first_job():
    s = Token2WavStream(pt, pf, emb, stream=True, schedule=ChunkSchedule(first_hop=15, prompt_align=1), noise=NSFNoise.zero())
    return s.next_job(toks, llm_done=True)
def timed():
    job = first_job(); torch.cuda.synchronize(); t = time.perf_counter(); runner.run(job); torch.cuda.synchronize(); return round((time.perf_counter()-t)*1000,1)
for _ in range(3): timed()
print('main thread', [timed() for _ in range(4)])
ex = ThreadPoolExecutor(1)
print('executor thread', [ex.submit(timed).result() for _ in range(4)])
async def in_loop():
    loop = asyncio.get_running_loop()
    return [await loop.run_in_executor(ex, timed) for _ in range(4)]
print('executor under asyncio', asyncio.run(in_loop()))
stop = False
def spin():
    x = torch.zeros(1, device='cuda')
    while not stop:
        x += 1; x.item()
th = threading.Thread(target=spin); th.start()
print('with a busy sync-loop thread', [timed() for _ in range(4)])
stop = True; th.join()
import gc; gc.disable(); print('gc off', [timed() for _ in range(4)]); gc.enable()
