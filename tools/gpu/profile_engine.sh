# Profile the engine on 2 x H200, one case per process, each bounded by timeout (issue 15):
#   device run: bash tools/gpu/profile_engine.sh   -> $OUT/log.txt, $OUT/p.tgz, $OUT/stacks/
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD:$PWD/kernels
export PCPVIZ_STACK_DUMP=$OUT/stacks:40
nvidia-smi --query-gpu=name,memory.used --format=csv > $OUT/smi.txt 2>&1
run() { local t=$1; shift; echo "== $* ($(date +%T))" >> $OUT/log.txt; timeout $t python benchmarks/profile_engine.py --out $OUT/p "$@" >> $OUT/log.txt 2>&1; echo "rc=$? $(date +%T)" >> $OUT/log.txt; }
run 200 --case decode --pcp 2 --k 2 --graphs on --decode-tokens 64
run 150 --case prefill --pcp 1
run 150 --case prefill --pcp 2
run 120 --case decode --pcp 1 --k 0 --decode-tokens 96
run 120 --case decode --pcp 1 --k 2 --decode-tokens 96
ps aux | grep -c rank_main >> $OUT/log.txt
cd $OUT && tar czf p.tgz p && rm -rf p
