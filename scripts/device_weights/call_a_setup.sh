# call A: stage the first GGUF half, the token ids and the wheels on the warm device machine
set -e
mkdir -p /root/stage && cp .devdata/p1 .devdata/gguf.sha256 .devdata/tokens.pt /root/stage/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nproc; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; ls -la /root/stage
