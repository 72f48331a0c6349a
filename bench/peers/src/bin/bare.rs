//! `bare`: the handler alone, no idempotency. The floor, and the upstream of nginx and `idem serve`.

#[tokio::main]
async fn main() {
    let addr = idem_bench_peers::listen_addr();
    idem_bench_peers::serve("bare", addr, idem_bench_peers::router()).await;
}
