test -f /root/stage/p1 || { echo "NO STAGE: fresh machine"; exit 3; }
cp .devdata2/p2 /root/stage/ && ls -la /root/stage
