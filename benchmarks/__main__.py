from benchmarks.matrix import main

main()
