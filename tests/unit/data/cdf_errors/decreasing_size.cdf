# sizes out of order
0 0
1000 0.2
5000 0.5

2000 0.7
10000 1
