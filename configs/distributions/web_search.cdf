# web_search: flow sizes of a production web-search cluster, from M. Alizadeh et al.,
# "Data Center TCP (DCTCP)", ACM SIGCOMM 2010, as HPCC (Y. Li et al., "HPCC: High Precision
# Congestion Control", ACM SIGCOMM 2019) ships and uses them.
#
# Read from github.com/alibaba-edu/High-Precision-Congestion-Control, traffic_gen/WebSearch_distribution.txt
# (last changed in commit 9cf8b9e8c8d04a3775e06c972c4699dcbce53c37; identical at 9f4be2a9ead8a90e8bf732c66bd758c00e58e5be).
# The points are reproduced unchanged: size in bytes, cumulative probability in percent
# (the last row is 100). Sizes between points are linearly interpolated, as HPCC's
# traffic_gen/custom_rand.py does (testbed/workloads/flowgen.py, docs/flows-distributions.md).
0 0
10000 15
20000 20
30000 30
50000 40
80000 53
200000 60
1000000 70
2000000 80
5000000 90
10000000 97
30000000 100
