from spmd.controller.start import main

main()
