pub mod references;
