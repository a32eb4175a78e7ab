from specllm.cli import main

main()
