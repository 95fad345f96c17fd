//! `nomad health ADDRESS`: whether a Nomad server answers its gRPC health check as serving
//! (for container health checks).

use std::time::Duration;

/// Whether the server at `address` reports SERVING within 5 s.
pub async fn health(address: &str) -> anyhow::Result<bool> {
    // Over TLS when NOMAD_TLS_CA is set.
    nomad_rpc::tls::configure_from(&nomad_config::ConfigFile::default(), false)?;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    let mut client = HealthClient::new(nomad_rpc::channel(address)?);
    let reply = tokio::time::timeout(
        Duration::from_secs(5),
        client.check(HealthCheckRequest::default()),
    )
    .await;
    match reply {
        Ok(Ok(r)) if r.get_ref().status == ServingStatus::Serving as i32 => Ok(true),
        Ok(Ok(r)) => {
            eprintln!("{address}: {:?}", r.get_ref().status());
            Ok(false)
        }
        Ok(Err(status)) => {
            eprintln!("{address}: {}", status.message());
            Ok(false)
        }
        Err(_) => {
            eprintln!("{address}: no answer within 5 s");
            Ok(false)
        }
    }
}
