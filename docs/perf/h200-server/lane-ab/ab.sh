#!/bin/bash
# A/B of the token2wav first-chunk lane through the gRPC server: the same tree with the lane on
# (lane) and with the lane test forced off (nolane: every batch by deadline, the old rule).
O=$1; D=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl || exit 4
for v in lane nolane; do rm -rf /tmp/$v; mkdir -p /tmp/$v; tar xf after.tar -C /tmp/$v; done
sed -i 's/        if self._first and (self._last_lane != FIRST_LANE or not self._rest):/        if False:/' /tmp/nolane/async_cosyvoice/token2wav_batcher.py
grep -c "if False:" /tmp/nolane/async_cosyvoice/token2wav_batcher.py || exit 5
export PYTHONUNBUFFERED=1
PYTHONPATH=/tmp/lane:/tmp/site python3 -c "from async_cosyvoice.tools.make_random_model import make_random_model as m; m('cosyvoice2-0.5b', '/tmp/m', seed=0)" || exit 6
for v in nolane lane; do
  cd /tmp/$v; export PYTHONPATH=/tmp/$v:/tmp/site
  python3 -c "import yaml; d=yaml.safe_load(open('configs/gpu.yaml')); d['model']['dir']='/tmp/m'; d['speakers']['dir']='/tmp/spk-$v'; d['server'].update(host='127.0.0.1', port=50051, metrics_port=9090); yaml.safe_dump(d, open('/tmp/$v.yaml','w'))"
  t0=$(date +%s)
  python3 -m async_cosyvoice.cli serve --config /tmp/$v.yaml > /tmp/$v-server.log 2>&1 &
  PID=$!
  python3 -c "
import asyncio
from grpc_async.client import CosyVoiceClient
async def main():
    async with CosyVoiceClient('127.0.0.1:50051') as c:
        await c.wait_ready(timeout=300)
asyncio.run(main())" || { tail -30 /tmp/$v-server.log; kill $PID; exit 7; }
  echo "$v: SERVING after $(( $(date +%s) - t0 )) s"
  timeout 200 python3 -m async_cosyvoice.cli bench --target 127.0.0.1:50051 --metrics 127.0.0.1:9090 --tokens 250 \
    --concurrency 4,16 --requests 8,32 --open-loop --rate 0.5,1 --duration 20 --max-level-seconds 20 \
    --out $O/ab-$v.json --no-plots --quiet > $O/ab-$v.txt 2>&1
  echo "$v bench rc $?"; cat $O/ab-$v.txt
  kill -INT $PID; wait $PID
  tail -5 /tmp/$v-server.log
  cd $D
done
