# Session 17: fill the inductor cache with GoogLeNet's dense max-autotune choices (fp32, N=32) in
# PARTS processes at once (`warm_dense_compile.py --part`), under TORCHINDUCTOR_CACHE_DIR (kept on
# the machine for the next call), stopped after WARM_TIMEOUT_S; each finished shape is cached.
source scripts/device-env.sh
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/ind-googlenet} TORCHINDUCTOR_COMPILE_THREADS=4
parts=${PARTS:-12}
start=$SECONDS
for ((i = 0; i < parts; i++)); do
    timeout "${WARM_TIMEOUT_S:-520}" python3 scripts/warm_dense_compile.py googlenet --batch 32 --dtype fp32 \
        --mode max-autotune --part "$i/$parts" >"$OUT/warm-part$i.log" 2>&1 &
done
wait
echo "warm: $((SECONDS - start)) s"
cat "$OUT"/warm-part*.log | grep -E "^compiled|AUTOTUNE (conv|mm)|benchmarking takes" >"$OUT/warm-googlenet.txt"
grep -c "benchmarking takes" "$OUT/warm-googlenet.txt"; grep "^compiled" "$OUT/warm-googlenet.txt"
for log in "$OUT"/warm-part*.log; do echo "== $log"; grep -v "^E1123" "$log" | tail -n 15; done >"$OUT/warm-tails.txt"
rm -f "$OUT"/warm-part*.log
