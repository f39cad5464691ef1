# Session 17: ResNet-50 DLMC 0.9 (fp32, N=32) in eager mode, session 16's code (94cd53c, carried in
# .carry/s16) against this tree, alternating on one machine: is the eager time a code or a machine effect?
source scripts/device-env.sh
for round in 1 2; do
    for tree in s16 head; do
        src=$PWD/src commit=$SPARSECNN_COMMIT; [ "$tree" = s16 ] && src=$PWD/.carry/s16/src commit=94cd53c
        SPARSECNN_COMMIT=$commit PYTHONPATH=$src SPARSECNN_CACHE_DIR=/tmp/sc-ab-$tree timeout 120 python3 -m sparsecnn.cli bench model resnet50 \
            --batch 32 --dtype fp32 --pattern dlmc-magnitude_pruning --sparsity 0.9 --modes eager,cudagraph \
            --out "$OUT/models.jsonl" >"$OUT/ab-$tree-$round.log" 2>&1
        echo "$tree round $round:"; grep -E "^\| auto \| (eager|cudagraph)" "$OUT/ab-$tree-$round.log" | head -2
    done
done
