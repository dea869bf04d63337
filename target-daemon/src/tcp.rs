//! NVMe/TCP transport.
use std::sync::Arc;
/// Serves one connection.
pub async fn serve(_target: Arc<crate::target::Target>, _stream: tokio::net::TcpStream) {}
