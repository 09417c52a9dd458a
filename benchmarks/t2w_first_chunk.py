import time, torch, numpy as np
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.token2wav import *
from async_cosyvoice.models.hift import NSFNoise
md = load_model_dir('/tmp/m05'); m = build_models(md, device='cuda', dtype=torch.float16)
runner = Token2WavRunner(m.flow, m.hift)
g = torch.Generator().manual_seed(0)
pt = torch.randint(0, 6561, (1, 150), generator=g, dtype=torch.int32); pf = torch.randn(1, 300, 80, generator=g); emb = torch.randn(1, 192, generator=g)
toks = torch.randint(0, 6561, (120,), generator=g).tolist()
for rep in range(4):
    s = Token2WavStream(pt, pf, emb, stream=True, schedule=ChunkSchedule(first_hop=15, prompt_align=1), noise=NSFNoise.random(torch.Generator().manual_seed(rep)))
    ts = []
    while (job := s.next_job(toks, llm_done=True)) is not None:
        torch.cuda.synchronize(); t = time.perf_counter()
        runner.run(job)
        torch.cuda.synchronize(); ts.append(round((time.perf_counter() - t) * 1000, 1))
    print('chunk ms', ts, flush=True)
job_t = {}
s = Token2WavStream(pt, pf, emb, stream=True, schedule=ChunkSchedule(first_hop=15, prompt_align=1), noise=NSFNoise.zero())
job = s.next_job(toks, llm_done=True)
torch.cuda.synchronize(); t = time.perf_counter(); mels = runner.flow_mels([job]); torch.cuda.synchronize(); print('flow_mels', round((time.perf_counter()-t)*1000,1))
t = time.perf_counter(); mel, cache = s.hift_input(job, mels[0]); sp, so = m.hift.inference(mel, cache, NSFNoise.zero()); torch.cuda.synchronize(); print('hift', round((time.perf_counter()-t)*1000,1), tuple(mel.shape))
from torch.profiler import profile, ProfilerActivity
s = Token2WavStream(pt, pf, emb, stream=True, schedule=ChunkSchedule(first_hop=15, prompt_align=1), noise=NSFNoise.zero())
job = s.next_job(toks, llm_done=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    runner.run(job); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
