# alibaba_storage: flow sizes of Alibaba's production distributed storage system in 2019, as
# shipped with HPCC (AliStorage2019); HPCC's traffic_gen/README.md is their only description.
#
# Read from github.com/alibaba-edu/High-Precision-Congestion-Control, traffic_gen/AliStorage2019.txt
# (last changed in commit fe18e47f4cded502eb5f9c99e4a4941645ab889b; identical at 9f4be2a9ead8a90e8bf732c66bd758c00e58e5be).
# The points are reproduced unchanged: size in bytes, cumulative probability in percent
# (the last row is 100). Sizes between points are linearly interpolated, as HPCC's
# traffic_gen/custom_rand.py does (testbed/workloads/flowgen.py, docs/flows-distributions.md).
0 0
4000 22.93
8000 69.21
16000 80.61
32000 90.47
64000 93.53
128000 96.77
256000 97.53
2000000 100
