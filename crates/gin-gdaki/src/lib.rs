//! gin-gdaki: the GPU-initiated backend. Device code builds mlx5 work-queue
//! entries itself, marks them ready in order, rings the doorbell, and polls
//! completion queues. NICs: soft-mlx5, a software NIC that executes the very
//! WQE bytes over gin-net (so CI runs the whole path), and mlx5 devx on a real
//! ConnectX, loaded at run time.
//!
//! Not yet built: an empty library until the GDAKI issue fills it.
