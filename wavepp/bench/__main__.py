from wavepp.bench.matrix import main

main()
