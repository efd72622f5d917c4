# hadoop: flow sizes of Facebook's Hadoop cluster, from A. Roy, H. Zeng, J. Bagga, G. Porter
# and A. C. Snoeren, "Inside the Social Network's (Datacenter) Network", ACM SIGCOMM 2015,
# as HPCC (Y. Li et al., ACM SIGCOMM 2019) ships and uses them (FbHdp).
#
# Read from github.com/alibaba-edu/High-Precision-Congestion-Control, traffic_gen/FbHdp_distribution.txt
# (last changed in commit 9cf8b9e8c8d04a3775e06c972c4699dcbce53c37; identical at 9f4be2a9ead8a90e8bf732c66bd758c00e58e5be).
# The points are reproduced unchanged: size in bytes, cumulative probability in percent
# (the last row is 100). Sizes between points are linearly interpolated, as HPCC's
# traffic_gen/custom_rand.py does (testbed/workloads/flowgen.py, docs/flows-distributions.md).
0 0
100 1
200 2
300 5
350 15
400 20
500 30
600 40
700 50
1000 60
2000 67
7000 70
30000 72
50000 82
80000 87
120000 90
300000 95
1000000 97.5
2000000 99
10000000 100
